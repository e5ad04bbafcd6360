//! Search verbs: `find` (a regex over the files of a tree, matches streamed) and `replace` (a
//! regex rewrite of a list of files, atomic per file).
//!
//! `find` walks on a blocking thread that hands batches of matches to the connection through a
//! short bounded channel. A client that stops reading fills the socket, then the channel, and the
//! walker blocks on its next send; `Cancel` (or the client leaving) drops the channel, which the
//! walker checks before every file, so it stops within one file. Memory is bounded by the
//! channel (a few batches), the walker's directory stack, and one file buffer of at most
//! `max_file_bytes`. Files with a NUL byte in their first 8 KiB are taken as binary and skipped,
//! as are files over the size limit; symlinks are not followed. Match order follows the
//! directory walk (not sorted).
//!
//! `replace` rewrites the files in the order given, each through a temp file renamed over the
//! original (mode and owner kept), so a crash leaves every file either old or new. The first
//! file that fails ends the call with its error: the files before it stay rewritten (each one
//! was reported with `Replaced`), the ones after it are not touched.
//!
//! Globs are translated to a regex by hand (`*`, `?`, `[...]`, `[!...]`, `{a,b}`, `**`, `\`
//! escapes): the `regex` crate is already here, and the translation is a few dozen lines.

use std::io::Read;
use std::path::{Path, PathBuf};

use regex::bytes::{Regex, RegexBuilder};
use silk_proto::{
    ErrorKind, FindRequest, Frame, FrameReader, FrameWriter, Match, ReplaceRequest, WireError,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

use crate::call::{CallResult, interrupted};
use crate::files::{blocking, checked_path, io_error, open_temp_for};

/// Batches in flight between the walker and the socket.
const PIPELINE: usize = 4;
/// Matches per `Matches` frame, and the bytes of line text that close a batch early.
const BATCH: usize = 256;
const BATCH_BYTES: usize = 256 * 1024;
/// Longest line text sent; the rest of a longer line is cut (at a character boundary).
const MAX_LINE: usize = 4096;
/// Bytes looked at for a NUL to call a file binary.
const BINARY_SNIFF: usize = 8192;
const DEFAULT_MAX_FILE: u64 = 16 << 20;
/// Ceiling on the caller's `max_file_bytes` (the walker holds one such file in memory), and on
/// files given to `replace`.
const MAX_FILE: u64 = 256 << 20;
/// Ceiling on compiled regex size, so a hostile pattern cannot eat the agent's memory.
const REGEX_SIZE: usize = 16 << 20;

fn compile(pattern: &str) -> Result<Regex, WireError> {
    RegexBuilder::new(pattern)
        .multi_line(true)
        .size_limit(REGEX_SIZE)
        .build()
        .map_err(|e| WireError::new(ErrorKind::BadRequest, format!("bad regex: {e}")))
}

pub async fn find<R, W>(
    req: FindRequest,
    rd: &mut FrameReader<R>,
    wr: &mut FrameWriter<W>,
) -> CallResult
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let root = checked_path(&req.path)?;
    let regex = compile(&req.pattern)?;
    let glob = req.glob.as_deref().map(Glob::new).transpose()?;
    std::fs::symlink_metadata(&root).map_err(|e| io_error(&root, e))?;
    let walk = Walk {
        root,
        regex,
        glob,
        max_file: req.max_file_bytes.unwrap_or(DEFAULT_MAX_FILE).min(MAX_FILE),
        max_matches: req.max_matches.unwrap_or(u64::MAX),
    };
    let (tx, mut rx) = mpsc::channel(PIPELINE);
    tokio::task::spawn_blocking(move || walk.run(&tx));
    loop {
        tokio::select! {
            batch = rx.recv() => match batch {
                Some(batch) => wr.send(&Frame::Matches(batch)).await?,
                None => break,
            },
            frame = rd.recv() => match frame {
                // Dropping `rx` on the way out stops the walker.
                Ok(Some(Frame::Cancel)) => break,
                Ok(Some(Frame::Stdin(_) | Frame::Data(_) | Frame::Eof)) => {}
                other => return Err(interrupted(other, "during a find; the find was stopped")),
            },
        }
    }
    Ok(wr.send(&Frame::Done).await?)
}

/// The walker's side of a find.
struct Walk {
    root: PathBuf,
    regex: Regex,
    glob: Option<Glob>,
    max_file: u64,
    max_matches: u64,
}

impl Walk {
    fn run(&self, tx: &mpsc::Sender<Vec<Match>>) {
        let mut batch = Vec::with_capacity(BATCH);
        let mut batch_bytes = 0;
        let mut found = 0u64;
        let mut buf = Vec::new();
        // Unreadable directories and files vanishing mid-walk are skipped, as `grep -r` does.
        for entry in walkdir::WalkDir::new(&self.root).follow_links(false) {
            if tx.is_closed() {
                return; // cancelled, or the client is gone
            }
            let Ok(entry) = entry else { continue };
            if !entry.file_type().is_file() || !self.wanted(entry.path()) {
                continue;
            }
            if !self.load(entry.path(), &mut buf) {
                continue;
            }
            let path = entry.path().to_string_lossy();
            for (line, text) in matching_lines(&self.regex, &buf) {
                batch_bytes += text.len() + path.len();
                batch.push(Match { path: path.clone().into_owned(), line, text });
                found += 1;
                let last = found >= self.max_matches;
                if batch.len() >= BATCH || batch_bytes >= BATCH_BYTES || last {
                    batch_bytes = 0;
                    if tx.blocking_send(std::mem::take(&mut batch)).is_err() || last {
                        return;
                    }
                }
            }
        }
        if !batch.is_empty() {
            let _ = tx.blocking_send(batch);
        }
    }

    fn wanted(&self, path: &Path) -> bool {
        let Some(glob) = &self.glob else { return true };
        if glob.whole_path {
            let rel = path.strip_prefix(&self.root).unwrap_or(path);
            glob.matches(&rel.to_string_lossy())
        } else {
            path.file_name().is_some_and(|n| glob.matches(&n.to_string_lossy()))
        }
    }

    /// Reads a text file within the size limit into `buf`; false for binary, too big, or
    /// unreadable.
    fn load(&self, path: &Path, buf: &mut Vec<u8>) -> bool {
        buf.clear();
        let Ok(file) = std::fs::File::open(path) else { return false };
        if file.metadata().map_or(true, |m| m.len() > self.max_file) {
            return false;
        }
        // `take` guards against a file that grows after the size check.
        let mut limited = file.take(self.max_file + 1);
        if limited.read_to_end(buf).is_err() || buf.len() as u64 > self.max_file {
            return false;
        }
        !buf[..buf.len().min(BINARY_SNIFF)].contains(&0)
    }
}

/// Every line with a match: (1-based line number, line text). One entry per line however many
/// matches it holds; a match spanning lines is reported on the line where it starts.
fn matching_lines<'a>(regex: &'a Regex, buf: &'a [u8]) -> impl Iterator<Item = (u64, String)> + 'a {
    let mut line_no = 1u64;
    let mut counted_to = 0;
    let mut next_line_start = 0;
    regex.find_iter(buf).filter_map(move |m| {
        if m.start() < next_line_start {
            return None; // a second match on a line already reported
        }
        line_no += buf[counted_to..m.start()].iter().filter(|&&b| b == b'\n').count() as u64;
        counted_to = m.start();
        let start = buf[..m.start()].iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let end =
            buf[m.start()..].iter().position(|&b| b == b'\n').map_or(buf.len(), |i| m.start() + i);
        next_line_start = end + 1;
        let line = &buf[start..end];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        Some((line_no, cut(line)))
    })
}

fn cut(line: &[u8]) -> String {
    let text = String::from_utf8_lossy(&line[..line.len().min(MAX_LINE)]);
    // Cutting may have split a character; lossy decoding turned it into U+FFFD. Keep that: the
    // line is marked as cut either way.
    text.into_owned()
}

pub async fn replace<W: AsyncWrite + Unpin>(
    req: ReplaceRequest,
    wr: &mut FrameWriter<W>,
) -> CallResult {
    let regex = compile(&req.pattern)?;
    let paths = req.paths.iter().map(|p| checked_path(p)).collect::<Result<Vec<_>, _>>()?;
    for (given, path) in req.paths.into_iter().zip(paths) {
        let (regex, replacement) = (regex.clone(), req.replacement.clone());
        let count = blocking(move || replace_file(&path, &regex, replacement.as_bytes())).await?;
        wr.send(&Frame::Replaced { path: given, count }).await?;
    }
    Ok(wr.send(&Frame::Done).await?)
}

/// Rewrites one file through a temp file and a rename; returns the number of replacements.
fn replace_file(path: &Path, regex: &Regex, replacement: &[u8]) -> Result<u64, WireError> {
    // A symlink is followed: the file it names is rewritten and the link stays a link.
    let path = std::fs::canonicalize(path).map_err(|e| io_error(path, e))?;
    let meta = std::fs::metadata(&path).map_err(|e| io_error(&path, e))?;
    if !meta.is_file() {
        return Err(WireError::new(
            ErrorKind::BadRequest,
            format!("{} is not a regular file", path.display()),
        ));
    }
    if meta.len() > MAX_FILE {
        return Err(WireError::new(
            ErrorKind::ResourceExhausted,
            format!("{} is larger than {MAX_FILE} bytes", path.display()),
        ));
    }
    let data = std::fs::read(&path).map_err(|e| io_error(&path, e))?;
    let count = regex.find_iter(&data).count() as u64;
    if count == 0 {
        return Ok(0);
    }
    let new = regex.replace_all(&data, replacement);
    let (tmp, mut file) = open_temp_for(&path, None, false)?;
    let written = std::io::Write::write_all(&mut file, &new)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| io_error(&path, e));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map(|()| count)
}

/// A file-name glob, compiled to a regex.
#[derive(Debug)]
struct Glob {
    regex: regex::Regex,
    /// The glob has a `/`: it matches the path relative to the root, not the name.
    whole_path: bool,
}

impl Glob {
    fn new(glob: &str) -> Result<Glob, WireError> {
        let bad =
            |why: &str| WireError::new(ErrorKind::BadRequest, format!("bad glob {glob:?}: {why}"));
        let mut re = String::from("^");
        let mut chars = glob.chars().peekable();
        let mut braces = 0usize;
        while let Some(c) = chars.next() {
            match c {
                '*' if chars.peek() == Some(&'*') => {
                    chars.next();
                    if chars.peek() == Some(&'/') {
                        chars.next();
                        re.push_str("(?:.*/)?"); // `**/`: any number of directories
                    } else {
                        re.push_str(".*");
                    }
                }
                '*' => re.push_str("[^/]*"),
                '?' => re.push_str("[^/]"),
                '[' => {
                    re.push('[');
                    if matches!(chars.peek(), Some('!' | '^')) {
                        chars.next();
                        re.push('^');
                    }
                    let mut first = true;
                    loop {
                        match chars.next() {
                            None => return Err(bad("unclosed '['")),
                            Some(']') if !first => break,
                            Some(c @ ('\\' | '[' | ']' | '&' | '~')) => {
                                re.push('\\');
                                re.push(c);
                            }
                            Some(c) => re.push(c),
                        }
                        first = false;
                    }
                    re.push(']');
                }
                '{' => {
                    braces += 1;
                    re.push_str("(?:");
                }
                ',' if braces > 0 => re.push('|'),
                '}' if braces > 0 => {
                    braces -= 1;
                    re.push(')');
                }
                '\\' => match chars.next() {
                    Some(c) => re.push_str(&regex::escape(&c.to_string())),
                    None => return Err(bad("ends with '\\'")),
                },
                c => re.push_str(&regex::escape(&c.to_string())),
            }
        }
        if braces > 0 {
            return Err(bad("unclosed '{'"));
        }
        re.push('$');
        let regex = regex::Regex::new(&re).map_err(|e| bad(&e.to_string()))?;
        Ok(Glob { regex, whole_path: glob.contains('/') })
    }

    fn matches(&self, name: &str) -> bool {
        self.regex.is_match(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_like_a_shell() {
        let g = |glob: &str, name: &str| Glob::new(glob).unwrap().matches(name);
        assert!(g("*.rs", "main.rs"));
        assert!(!g("*.rs", "main.rsx"));
        assert!(g("file?.[ch]", "file1.c"));
        assert!(!g("file?.[!ch]", "file1.c"));
        assert!(g("*.{js,ts}", "app.ts"));
        assert!(!g("*.{js,ts}", "app.rs"));
        assert!(g("src/**/*.rs", "src/a/b/c.rs"));
        assert!(g("src/**/*.rs", "src/c.rs"));
        assert!(!g("src/*.rs", "src/a/c.rs"));
        assert!(g("a+b(1).txt", "a+b(1).txt"), "regex metacharacters are literal");
        assert!(g(r"\*", "*"));
        assert!(g("[]x]", "]"));
        for bad in ["[abc", "{a,b", "x\\"] {
            assert_eq!(Glob::new(bad).unwrap_err().kind, ErrorKind::BadRequest, "{bad}");
        }
    }

    #[test]
    fn lines_are_numbered_and_reported_once() {
        let re = compile("o+").unwrap();
        let buf = b"foo boo\nbar\r\nzoo\nlast o";
        let got: Vec<_> = matching_lines(&re, buf).collect();
        assert_eq!(
            got,
            vec![(1, "foo boo".to_string()), (3, "zoo".to_string()), (4, "last o".to_string())]
        );
        let re = compile("^bar$").unwrap();
        assert_eq!(matching_lines(&re, b"foo\nbar\n").collect::<Vec<_>>(), vec![(2, "bar".into())]);
        assert_eq!(compile("(").unwrap_err().kind, ErrorKind::BadRequest);
    }

    #[test]
    fn long_lines_are_cut() {
        let re = compile("x").unwrap();
        let line = vec![b'x'; MAX_LINE * 3];
        let (_, text) = matching_lines(&re, &line).next().unwrap();
        assert_eq!(text.len(), MAX_LINE);
    }
}
