//! [`capture`]: an overlay upper directory (or a golden's layer) written as a layer tar,
//! read as the hostile tree it is.

use super::*;

/// Writes `layers` (an overlay upper directory, or a golden's layer, and the read-only layers
/// under it that belong to the same sandbox, top first) as one OCI-style layer tar, with owners
/// translated from the host range `ids` to the ids the sandbox sees.
///
/// Several layers are merged as overlayfs shows them: a name is taken from the topmost layer
/// that has it (a whiteout there is a deletion, a file or symlink hides what is under it), and
/// a directory merges the layers below it down to the first that hides them (an opaque
/// directory, a whiteout, a non-directory): a directory cut off that way is opaque in the
/// result too, so the tar stands alone over the same base as the bottom layer.
///
/// The trees belong to a sandbox, so they are read as hostile: every directory is opened with
/// `O_NOFOLLOW` relative to its parent's descriptor and every file the same way (and checked to
/// be the inode just listed), so no symlink or rename leads the capture out of the tree. Files
/// keep their size on the wire: holes are written as GNU sparse entries (`SEEK_DATA`/`SEEK_HOLE`)
/// and a file with several links is written once, then as hard links. A name starting with
/// `.wh.` is refused: it would turn into a deletion when the tar is applied.
pub fn capture(layers: &[&Path], out: impl std::io::Write, ids: Ids) -> Result<()> {
    let mut capture =
        Capture { tar: tar::Builder::new(out), ids, links: HashMap::new(), buf: vec![0; 1 << 20] };
    let mut roots = vec![];
    for layer in layers {
        roots.push(
            open_dir(libc::AT_FDCWD, &cpath(layer)?)
                .map_err(EngineError::io(format!("open {}", layer.display())))?,
        );
    }
    // Depth first with a stack of open directories rather than recursion: a sandbox can nest
    // directories deeper than any thread's stack would take.
    let mut stack = vec![Frame::open(roots, PathBuf::new())?];
    while let Some(top) = stack.last_mut() {
        let Some(name) = top.names.next() else {
            stack.pop();
            continue;
        };
        if let Some(sub) = capture.entry(&top.dirs, &top.rel, name)? {
            stack.push(sub);
        }
    }
    capture.tar.into_inner().map_err(EngineError::io("finish layer"))?;
    Ok(())
}

/// A directory being captured: its descriptor in each layer that shows through here (top
/// first), its path in the layer, the names left in it (those of all its layers, once each).
struct Frame {
    dirs: Vec<OwnedFd>,
    rel: PathBuf,
    names: std::vec::IntoIter<std::ffi::OsString>,
}

impl Frame {
    fn open(dirs: Vec<OwnedFd>, rel: PathBuf) -> Result<Frame> {
        let mut names = vec![];
        for dir in &dirs {
            let listing = format!("/proc/self/fd/{}", dir.as_raw_fd());
            let listed = std::fs::read_dir(&listing)
                .map_err(EngineError::io(format!("read {}", rel.display())))?;
            names.extend(listed.filter_map(|e| e.ok().map(|e| e.file_name())));
        }
        names.sort();
        names.dedup();
        Ok(Frame { dirs, rel, names: names.into_iter() })
    }
}

/// Longest path a capture takes: a restore could not make a longer one.
const MAX_PATH: usize = libc::PATH_MAX as usize - 1;

struct Capture<W: std::io::Write> {
    tar: tar::Builder<W>,
    ids: Ids,
    /// (dev, inode) of files with several links, and the path they were first written under.
    links: HashMap<(u64, u64), PathBuf>,
    /// What a file's bytes are read into on their way out (see [`Capture::append_read`]).
    buf: Vec<u8>,
}

impl<W: std::io::Write> Capture<W> {
    /// Writes the entry `name` of the directory whose layers are `dirs` (at `rel` in the
    /// layer); a directory is returned to be walked next.
    fn entry(
        &mut self,
        dirs: &[OwnedFd],
        rel: &Path,
        name: std::ffi::OsString,
    ) -> Result<Option<Frame>> {
        let path = rel.join(&name);
        if path.as_os_str().len() > MAX_PATH {
            return Err(EngineError::BadRequest(format!(
                "/{}... cannot be captured: its path is longer than {MAX_PATH} bytes",
                String::from_utf8_lossy(&path.as_os_str().as_bytes()[..64])
            )));
        }
        let cname = cpath(Path::new(&name))?;
        // The topmost layer that has the name decides what it is.
        let mut found = None;
        for (at, dir) in dirs.iter().enumerate() {
            match fstatat(dir.as_raw_fd(), &cname) {
                Ok(st) => {
                    found = Some((at, st));
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(EngineError::io(format!("stat {}", path.display()))(e)),
            }
        }
        let Some((at, st)) = found else { return Ok(None) }; // gone since it was listed
        let dir = dirs[at].as_raw_fd();
        let kind = st.st_mode & libc::S_IFMT;
        if is_whiteout(&st) {
            let wh = rel.join(format!("{WHITEOUT}{}", name.to_string_lossy()));
            append_empty(&mut self.tar, &wh)?;
            return Ok(None);
        }
        if name.as_bytes().starts_with(WHITEOUT.as_bytes()) {
            return Err(EngineError::BadRequest(format!(
                "/{} cannot be captured: names starting with {WHITEOUT} are reserved for \
                 deletions in layers (rename it)",
                path.display()
            )));
        }
        let mut header = tar::Header::new_gnu();
        header.set_mode(st.st_mode & 0o7777);
        header.set_uid(self.ids.from_host(st.st_uid).into());
        header.set_gid(self.ids.from_host(st.st_gid).into());
        header.set_mtime(st.st_mtime.max(0) as u64);
        header.set_size(0);
        let wrote = match kind {
            libc::S_IFDIR => {
                header.set_entry_type(EntryType::Directory);
                self.tar
                    .append_data(&mut header, &path, std::io::empty())
                    .map_err(EngineError::io(format!("archive {}", path.display())))?;
                let (subs, opaque) = self.merged_dir(&dirs[at..], &cname, &path)?;
                if opaque {
                    append_empty(&mut self.tar, &path.join(OPAQUE))?;
                }
                return Frame::open(subs, path).map(Some);
            }
            libc::S_IFLNK => {
                let target = readlinkat(dir, &cname)
                    .map_err(EngineError::io(format!("readlink {}", path.display())))?;
                header.set_entry_type(EntryType::Symlink);
                self.tar.append_link(&mut header, &path, target)
            }
            libc::S_IFREG => self.file(dir, &cname, &st, header, &path),
            libc::S_IFIFO => {
                header.set_entry_type(EntryType::Fifo);
                self.tar.append_data(&mut header, &path, std::io::empty())
            }
            // Sockets, and device nodes no sandbox can make: nothing to keep.
            _ => Ok(()),
        };
        wrote.map_err(EngineError::io(format!("archive {}", path.display())))?;
        Ok(None)
    }

    /// The directory `name` in each of `dirs` (top first; the first has it as a directory)
    /// down to the first layer that hides the rest, and whether it hides the base below all of
    /// them: opaque where it is cut off by an opaque directory or by a whiteout or a
    /// non-directory in a lower layer.
    fn merged_dir(
        &self,
        dirs: &[OwnedFd],
        name: &CStr,
        path: &Path,
    ) -> Result<(Vec<OwnedFd>, bool)> {
        let open = |dir: &OwnedFd| {
            open_dir(dir.as_raw_fd(), name)
                .map_err(EngineError::io(format!("open {}", path.display())))
        };
        let top = open(&dirs[0])?;
        let mut opaque = fget_xattr(top.as_raw_fd(), OPAQUE_XATTR).as_deref() == Some(b"y");
        let mut subs = vec![top];
        for dir in &dirs[1..] {
            if opaque {
                break;
            }
            let st = match fstatat(dir.as_raw_fd(), name) {
                Ok(st) => st,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(EngineError::io(format!("stat {}", path.display()))(e)),
            };
            if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
                opaque = true;
                break;
            }
            let sub = open(dir)?;
            opaque = fget_xattr(sub.as_raw_fd(), OPAQUE_XATTR).as_deref() == Some(b"y");
            subs.push(sub);
        }
        Ok((subs, opaque))
    }

    fn file(
        &mut self,
        dir: i32,
        name: &CStr,
        st: &libc::stat,
        mut header: tar::Header,
        path: &Path,
    ) -> std::io::Result<()> {
        if st.st_nlink > 1 {
            let key = (st.st_dev, st.st_ino);
            if let Some(first) = self.links.get(&key) {
                header.set_entry_type(EntryType::Link);
                return self.tar.append_link(&mut header, path, first);
            }
            self.links.insert(key, path.to_path_buf());
        }
        let file = std::fs::File::from(open_at(dir, name, libc::O_RDONLY | libc::O_NOCTTY)?);
        let meta = file.metadata()?;
        if meta.ino() != st.st_ino || meta.dev() != st.st_dev {
            return Err(std::io::Error::other("the file changed while it was captured"));
        }
        let size = meta.len();
        // Fewer blocks than bytes: holes (a file of nothing but a hole has no segments at all).
        let sparse = meta.blocks() * 512 < size;
        let segments = if sparse { data_segments(&file, size)? } else { vec![] };
        let stored: u64 = segments.iter().map(|s| s.1).sum();
        if !sparse || stored >= size {
            header.set_entry_type(EntryType::Regular);
            header.set_size(size);
            return self.append_read(&mut header, path, &file, size);
        }
        // A GNU sparse entry: the map (4 entries in the header, 21 per extension block that
        // follows it), then only the data segments.
        let mut map = segments.clone();
        if map.last().is_none_or(|&(off, len)| off + len < size) {
            map.push((size, 0)); // the file ends in a hole
        }
        header.set_entry_type(EntryType::GNUSparse);
        header.set_size(stored);
        let gnu = header.as_gnu_mut().expect("a GNU header");
        gnu.set_real_size(size);
        let (head, rest) = map.split_at(map.len().min(4));
        for (slot, &(off, len)) in gnu.sparse.iter_mut().zip(head) {
            slot.set_offset(off);
            slot.set_length(len);
        }
        gnu.set_is_extended(!rest.is_empty());
        let mut blocks = vec![];
        let chunks: Vec<_> = rest.chunks(21).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let mut ext = tar::GnuExtSparseHeader::new();
            for (slot, &(off, len)) in ext.sparse_mut().iter_mut().zip(chunk.iter()) {
                slot.set_offset(off);
                slot.set_length(len);
            }
            ext.set_is_extended(i + 1 < chunks.len());
            blocks.extend_from_slice(ext.as_bytes());
        }
        let len = blocks.len() as u64 + stored;
        let data =
            std::io::Cursor::new(blocks).chain(SegmentReader { file: &file, segments, at: 0 });
        self.append_read(&mut header, path, data, len)
    }

    /// Appends an entry whose `header` is followed by `len` bytes read from `data`, which must
    /// have that many (a file that shrank while it was captured must not leave the tar shorter
    /// than its header says: the sandbox's bytes would be read as the next entries).
    ///
    /// The bytes are copied here in 1 MiB reads: tar's own copy goes through an 8 KiB buffer
    /// behind `dyn Read`, a read call and a copy per 8 KiB (12 800 of each per 100 MiB).
    fn append_read(
        &mut self,
        header: &mut tar::Header,
        path: &Path,
        mut data: impl Read,
        len: u64,
    ) -> std::io::Result<()> {
        // tar writes the header (after a long-name entry if the path needs one) and no bytes;
        // the `len` bytes the header announces follow here.
        self.tar.append_data(header, path, std::io::empty())?;
        let out = self.tar.get_mut();
        let mut left = len;
        while left > 0 {
            let want = self.buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            let n = data.read(&mut self.buf[..want])?;
            if n == 0 {
                return Err(std::io::Error::other("the file shrank while it was captured"));
            }
            out.write_all(&self.buf[..n])?;
            left -= n as u64;
        }
        let pad = (512 - len % 512) % 512;
        out.write_all(&[0; 512][..pad as usize])
    }
}

/// The data segments of a sparse file as (offset, length), widened to 512-byte boundaries (tar's
/// sparse format needs every segment but the last to end on one).
fn data_segments(file: &std::fs::File, size: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let fd = file.as_raw_fd();
    let mut segments: Vec<(u64, u64)> = vec![];
    let mut pos = 0u64;
    while pos < size {
        // SAFETY: plain syscalls on an open descriptor.
        let data = unsafe { libc::lseek(fd, pos as i64, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole is left
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let start = data as u64 & !511;
        let end = ((hole as u64 + 511) & !511).min(size);
        match segments.last_mut() {
            Some((off, len)) if *off + *len >= start => *len = end - *off,
            _ => segments.push((start, end - start)),
        }
        pos = hole as u64;
    }
    Ok(segments)
}

/// Reads the given segments of a file back to back.
struct SegmentReader<'a> {
    file: &'a std::fs::File,
    segments: Vec<(u64, u64)>,
    at: usize,
}

impl Read for SegmentReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        while let Some(&(off, len)) = self.segments.get(self.at) {
            if len == 0 {
                self.at += 1;
                continue;
            }
            let want = buf.len().min(len as usize);
            let n = self.file.read_at(&mut buf[..want], off)?;
            if n == 0 {
                return Err(std::io::Error::other("the file shrank while it was captured"));
            }
            self.segments[self.at] = (off + n as u64, len - n as u64);
            return Ok(n);
        }
        Ok(0)
    }
}

/// Opens the directory `name` under `dirfd` without following a symlink.
fn open_dir(dirfd: i32, name: &CStr) -> std::io::Result<OwnedFd> {
    open_at(dirfd, name, libc::O_RDONLY | libc::O_DIRECTORY)
}

/// `openat` of `name` under `dirfd`, never following a symlink there (close-on-exec).
fn open_at(dirfd: i32, name: &CStr, flags: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscall on a valid C string; the result is a fresh descriptor we own.
    unsafe {
        let fd = libc::openat(dirfd, name.as_ptr(), flags | libc::O_NOFOLLOW | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// An overlayfs whiteout: a 0/0 character device.
fn is_whiteout(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFCHR && st.st_rdev == 0
}

fn fstatat(dirfd: i32, name: &CStr) -> std::io::Result<libc::stat> {
    // SAFETY: `st` is written by the kernel on success.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstatat(dirfd, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(st)
    }
}

fn readlinkat(dirfd: i32, name: &CStr) -> std::io::Result<PathBuf> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: the buffer is as long as we say.
    let n = unsafe { libc::readlinkat(dirfd, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(PathBuf::from(std::ffi::OsString::from_vec(buf)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capture() -> Capture<Vec<u8>> {
        Capture {
            tar: tar::Builder::new(vec![]),
            ids: Ids { base: 0 },
            links: HashMap::new(),
            buf: vec![0; 4],
        }
    }

    #[test]
    fn an_entry_whose_file_shrank_fails_rather_than_leave_the_tar_short() {
        let mut header = tar::Header::new_gnu();
        header.set_size(10);
        let err =
            capture().append_read(&mut header, Path::new("f"), &b"short"[..], 10).unwrap_err();
        assert!(err.to_string().contains("shrank"), "{err}");
    }

    #[test]
    fn an_entry_read_in_pieces_smaller_than_it_reads_back_whole_and_padded() {
        let long = "d/".repeat(80) + "file"; // past the header's 100 bytes: a long-name entry
        let mut c = capture();
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(EntryType::Regular);
        header.set_size(11);
        c.append_read(&mut header, Path::new(&long), &b"hello world"[..], 11).unwrap();
        let tar = c.tar.into_inner().unwrap();
        assert_eq!(tar.len() % 512, 0);
        let mut archive = tar::Archive::new(&tar[..]);
        let mut entries = archive.entries().unwrap();
        let mut entry = entries.next().unwrap().unwrap();
        assert_eq!(entry.path().unwrap(), Path::new(&long));
        let mut got = String::new();
        entry.read_to_string(&mut got).unwrap();
        assert_eq!(got, "hello world");
        assert!(entries.next().is_none());
    }
}
