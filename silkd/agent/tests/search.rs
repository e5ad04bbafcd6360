//! find and replace against a real silkd: filters, batching, early stop and backpressure over
//! 10 000 files, per-file atomicity (including a crash mid-call), and bad input.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::*;
use silk_proto::*;

fn find(path: &Path, pattern: &str, glob: Option<&str>) -> FindRequest {
    FindRequest {
        path: path_str(path),
        pattern: pattern.into(),
        glob: glob.map(String::from),
        max_file_bytes: None,
        max_matches: None,
    }
}

fn matches(r: &Reply) -> Vec<Match> {
    r.done();
    r.frames
        .iter()
        .flat_map(|f| match f {
            Frame::Matches(m) => m.clone(),
            other => panic!("unexpected {}", other.name()),
        })
        .collect()
}

/// Bytes silkd has read so far (files and sockets alike).
fn rchar(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
    io.lines().find_map(|l| l.strip_prefix("rchar: ")).unwrap().trim().parse().unwrap()
}

#[tokio::test]
async fn find_filters_by_glob_and_skips_binary_and_big_files() {
    let silkd = Silkd::start();
    let root = silkd.path("tree");
    std::fs::create_dir_all(root.join("src/deep")).unwrap();
    std::fs::write(root.join("src/main.rs"), "fn main() {\n    let needle = 1;\n}\n").unwrap();
    std::fs::write(root.join("src/deep/lib.rs"), "needle\r\nno\nneedle needle\n").unwrap();
    std::fs::write(root.join("notes.txt"), "a needle in text\n").unwrap();
    std::fs::write(root.join("blob.rs"), b"needle\0binary").unwrap();
    std::fs::write(root.join("big.rs"), format!("needle\n{}", "x".repeat(2 << 20))).unwrap();
    std::os::unix::fs::symlink("/etc", root.join("link")).unwrap();

    let mut c = silkd.connect().await;
    let mut req = find(&root, "needle", Some("*.rs"));
    req.max_file_bytes = Some(1 << 20);
    let mut got: Vec<(String, u64, String)> = matches(&c.call(Frame::Find(req)).await)
        .into_iter()
        .map(|m| (m.path.strip_prefix(&path_str(&root)).unwrap().to_string(), m.line, m.text))
        .collect();
    got.sort();
    let want = vec![
        ("/src/deep/lib.rs".to_string(), 1, "needle".to_string()),
        ("/src/deep/lib.rs".to_string(), 3, "needle needle".to_string()),
        ("/src/main.rs".to_string(), 2, "    let needle = 1;".to_string()),
    ];
    assert_eq!(got, want, "binary, oversize and non-matching files are skipped");

    // A glob with a slash matches the relative path; no glob searches everything (text only).
    let r = c.call(Frame::Find(find(&root, "needle", Some("src/**/*.rs")))).await;
    assert_eq!(matches(&r).len(), 3);
    let r = c.call(Frame::Find(find(&root, "^a need", None))).await;
    assert_eq!(matches(&r).len(), 1);
    // One file as the root.
    let r = c.call(Frame::Find(find(&root.join("notes.txt"), "needle", None))).await;
    assert_eq!(matches(&r)[0].line, 1);
}

#[tokio::test]
async fn find_over_ten_thousand_files_streams_in_batches_and_stops_early() {
    let silkd = Silkd::start();
    let root = silkd.path("many");
    let padding = "filler line that does not match\n".repeat(100);
    let hit = format!("match here {}\n", "m".repeat(500));
    let mut tree_bytes = 0;
    for d in 0..100 {
        let dir = root.join(format!("d{d:03}"));
        std::fs::create_dir_all(&dir).unwrap();
        for f in 0..100 {
            let body = format!("{hit}{padding}");
            tree_bytes += body.len() as u64;
            std::fs::write(dir.join(format!("f{f:03}.txt")), body).unwrap();
        }
    }

    // max_matches stops the walk at exactly that many.
    let mut c = silkd.connect().await;
    let mut req = find(&root, "^match here", None);
    req.max_matches = Some(300);
    let r = c.call(Frame::Find(req)).await;
    assert_eq!(matches(&r).len(), 300);
    assert!(r.frames.len() >= 2, "sent in batches");

    // A client that stops reading stops the walker: silkd's reads stall far short of the tree.
    let pid = silkd.child.id();
    let before = rchar(pid);
    c.send(Frame::Find(find(&root, "^match here", None))).await;
    let first = c.recv().await;
    assert!(matches!(&first, Frame::Matches(m) if !m.is_empty()), "got {}", first.name());
    let mut last = rchar(pid);
    eventually("walker blocked by backpressure", || {
        let now = rchar(pid);
        std::mem::replace(&mut last, now) == now
    })
    .await;
    let read = rchar(pid) - before;
    assert!(read < tree_bytes / 4, "walker read {read} of {tree_bytes} bytes while stalled");

    // Cancel: the call ends with Done after what was in flight, short of every match.
    c.send(Frame::Cancel).await;
    let mut n = match first {
        Frame::Matches(m) => m.len(),
        _ => unreachable!(),
    };
    let end = loop {
        match c.recv().await {
            Frame::Matches(m) => n += m.len(),
            other => break other,
        }
    };
    assert_eq!(end, Frame::Done);
    assert!(n < 10_000, "stopped early after {n} matches");
    // The walk really stopped: nothing more is being read.
    let settled = rchar(pid);
    c.call(Frame::Info).await.done();
    assert!(rchar(pid) - settled < tree_bytes / 4);

    // Read to the end this time: every file's match arrives.
    let r = c.call(Frame::Find(find(&root, "^match here", None))).await;
    assert_eq!(matches(&r).len(), 10_000);
}

#[tokio::test]
async fn find_bad_input_gets_typed_errors() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let dir = silkd.path("");
    let r = c.call(Frame::Find(find(&dir, "(unclosed", None))).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::BadRequest));
    let r = c.call(Frame::Find(find(&dir, "x", Some("[abc")))).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::BadRequest));
    let r = c.call(Frame::Find(find(&dir.join("missing"), "x", None))).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    c.call(Frame::Info).await.done();
}

fn replace(paths: &[&Path], pattern: &str, replacement: &str) -> Frame {
    Frame::Replace(ReplaceRequest {
        paths: paths.iter().map(|p| path_str(p)).collect(),
        pattern: pattern.into(),
        replacement: replacement.into(),
    })
}

#[tokio::test]
async fn replace_rewrites_each_file_and_stops_at_the_first_bad_one() {
    let silkd = Silkd::start();
    let (a, b, c_file) = (silkd.path("a.txt"), silkd.path("b.txt"), silkd.path("c.txt"));
    std::fs::write(&a, "foo1 foo2\nbar\n").unwrap();
    std::fs::write(&b, "nothing here\n").unwrap();
    std::fs::write(&c_file, "foo3\n").unwrap();
    std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o751)).unwrap();
    let mut c = silkd.connect().await;

    let r = c.call(replace(&[&a, &b], r"foo(\d)", "baz$1")).await;
    r.done();
    let counts: Vec<(String, u64)> = r
        .frames
        .iter()
        .map(|f| match f {
            Frame::Replaced { path, count } => (path.clone(), *count),
            other => panic!("unexpected {}", other.name()),
        })
        .collect();
    assert_eq!(counts, vec![(path_str(&a), 2), (path_str(&b), 0)]);
    assert_eq!(std::fs::read_to_string(&a).unwrap(), "baz1 baz2\nbar\n");
    assert_eq!(std::fs::metadata(&a).unwrap().permissions().mode() & 0o7777, 0o751, "mode kept");

    // The missing file stops the call: `a` before it is rewritten, `c` after it is untouched.
    std::fs::write(&a, "foo1\n").unwrap();
    let missing = silkd.path("missing.txt");
    let r = c.call(replace(&[&a, &missing, &c_file], "foo", "qux")).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    assert!(matches!(&r.frames[..], [Frame::Replaced { count: 1, .. }]));
    assert_eq!(std::fs::read_to_string(&a).unwrap(), "qux1\n");
    assert_eq!(std::fs::read_to_string(&c_file).unwrap(), "foo3\n");

    // A bad regex changes nothing; so does a directory.
    let r = c.call(replace(&[&c_file], "foo(", "x")).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::BadRequest));
    let r = c.call(replace(&[silkd.dir.path()], "foo", "x")).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::BadRequest));
    assert_eq!(std::fs::read_to_string(&c_file).unwrap(), "foo3\n");
    // No temp files are left behind.
    let leftovers: Vec<_> = std::fs::read_dir(silkd.dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".silk-"))
        .collect();
    assert!(leftovers.is_empty());
}

/// silkd killed in the middle of a replace: every file is either wholly old or wholly new.
#[tokio::test]
async fn a_crash_mid_replace_leaves_each_file_old_or_new() {
    let mut silkd = Silkd::start();
    let old: String = (0..8192).map(|i| format!("line {i} old\n")).collect();
    let new = old.replace("old", "new");
    let files: Vec<_> = (0..200).map(|i| silkd.path(&format!("f{i:03}"))).collect();
    for f in &files {
        std::fs::write(f, &old).unwrap();
    }
    let mut c = silkd.connect().await;
    let refs: Vec<&Path> = files.iter().map(|p| p.as_path()).collect();
    c.send(replace(&refs, "old", "new")).await;
    assert!(matches!(c.recv().await, Frame::Replaced { count: 8192, .. }));
    silkd.child.kill().unwrap();
    silkd.child.wait().unwrap();

    let (mut olds, mut news) = (0, 0);
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        if text == old {
            olds += 1;
        } else if text == new {
            news += 1;
        } else {
            panic!("{} is neither old nor new ({} bytes)", f.display(), text.len());
        }
    }
    assert!(news >= 1, "the reported file was replaced");
    assert_eq!(olds + news, files.len());
}
