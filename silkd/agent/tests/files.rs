//! File and tree verbs against a real silkd.

mod common;

use std::os::unix::fs::PermissionsExt;

use bytes::Bytes;
use common::*;
use silk_proto::*;

fn stat_of(r: &Reply) -> FileStat {
    match &r.frames[0] {
        Frame::StatReply(s) => s.clone(),
        other => panic!("expected StatReply, got {}", other.name()),
    }
}

#[tokio::test]
async fn write_read_stat_list_mkdir_rename_rm() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let dir = silkd.path("tree");
    let sub = dir.join("a/b");
    c.call(Frame::Mkdir { path: path_str(&sub), parents: true }).await.done();
    let r = c.call(Frame::Mkdir { path: path_str(&sub), parents: false }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::Conflict));

    let file = sub.join("f.txt");
    c.write(&file, b"hello").await.done();
    assert_eq!(c.read(&file).await.data(), b"hello");
    let r =
        c.call(Frame::Read(ReadRequest { path: path_str(&file), offset: 1, len: Some(3) })).await;
    assert_eq!(r.data(), b"ell");

    let st = stat_of(&c.call(Frame::Stat { path: path_str(&file) }).await);
    assert_eq!((st.kind, st.size, st.mode), (FileKind::File, 5, 0o644));

    for i in 0..600 {
        std::fs::write(dir.join(format!("n{i}")), b"").unwrap();
    }
    let r = c.call(Frame::List { path: path_str(&dir) }).await;
    r.done();
    let names: Vec<String> = r
        .frames
        .iter()
        .flat_map(|f| match f {
            Frame::Entries(e) => e.iter().map(|e| e.name.clone()).collect::<Vec<_>>(),
            other => panic!("unexpected {}", other.name()),
        })
        .collect();
    assert!(r.frames.len() >= 3, "listed in batches");
    assert_eq!(names.len(), 601);
    assert!(names.contains(&"a".to_string()));

    let moved = dir.join("moved.txt");
    c.call(Frame::Rename { from: path_str(&file), to: path_str(&moved) }).await.done();
    assert!(!file.exists());
    assert_eq!(std::fs::read(&moved).unwrap(), b"hello");

    let r = c.call(Frame::Rm { path: path_str(&dir), recursive: false }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::Conflict), "not empty");
    c.call(Frame::Rm { path: path_str(&dir), recursive: true }).await.done();
    assert!(!dir.exists());
}

#[tokio::test]
async fn write_keeps_mode_and_is_atomic_when_the_stream_breaks() {
    let silkd = Silkd::start();
    let file = silkd.path("script.sh");
    std::fs::write(&file, b"old").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o751)).unwrap();

    let mut c = silkd.connect().await;
    c.write(&file, b"new content").await.done();
    assert_eq!(std::fs::read(&file).unwrap(), b"new content");
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o7777, 0o751);

    // A client that dies mid-upload changes nothing and leaves no temp file behind.
    let mut c2 = silkd.connect().await;
    c2.send(Frame::Write(WriteRequest { path: path_str(&file), mode: None, parents: false })).await;
    c2.send(Frame::Data(Bytes::from(vec![b'x'; 1 << 20]))).await;
    drop(c2);
    let mut c3 = silkd.connect().await;
    eventually("temp file removed", || {
        std::fs::read_dir(silkd.dir.path()).unwrap().count() == 2 // socket + script.sh
    })
    .await;
    assert_eq!(c3.read(&file).await.data(), b"new content");
}

#[tokio::test]
async fn write_then_eof_creates_files_with_requested_mode() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let fresh = silkd.path("deep/er/fresh");
    c.conn
        .queue(&Frame::Write(WriteRequest {
            path: path_str(&fresh),
            mode: Some(0o666),
            parents: true,
        }))
        .unwrap();
    c.call(Frame::Eof).await.done();
    assert_eq!(std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o7777, 0o666);
    assert_eq!(std::fs::read(&fresh).unwrap(), b"");
}

#[tokio::test]
async fn file_errors_are_typed_and_the_connection_survives() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let missing = silkd.path("missing");
    assert_eq!(c.read(&missing).await.error_kind(), Some(ErrorKind::NotFound));
    assert_eq!(c.read(silkd.dir.path()).await.error_kind(), Some(ErrorKind::BadRequest));
    let r = c.call(Frame::Stat { path: path_str(&missing) }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    let r = c.call(Frame::List { path: path_str(&missing) }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    let r = c.call(Frame::Rm { path: path_str(&missing), recursive: true }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    let r = c.call(Frame::Pull { path: path_str(&missing) }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    let r = c.call(Frame::Stat { path: String::new() }).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::BadRequest));

    // Writing into a directory that does not exist: an error, then the client's data frames
    // are discarded and the connection keeps working.
    let r = c.write(&missing.join("x/y"), b"data").await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    let r = c.write(silkd.dir.path(), b"data").await;
    assert_eq!(r.error_kind(), Some(ErrorKind::BadRequest));
    assert_eq!(c.exec(&["true"]).await.exit().code, 0);
    c.call(Frame::Stat { path: path_str(silkd.dir.path()) }).await.done();
}

#[tokio::test]
async fn hundred_mib_write_and_read_keep_every_byte() {
    let silkd = Silkd::start();
    let data: Vec<u8> =
        (0..100u32 << 20).map(|i| (i.wrapping_mul(2246822519) >> 11) as u8).collect();
    let file = silkd.path("big.bin");
    let mut c = silkd.connect().await;
    c.write(&file, &data).await.done();
    assert_eq!(blake3::hash(&std::fs::read(&file).unwrap()), blake3::hash(&data));

    c.send(Frame::Read(ReadRequest { path: path_str(&file), offset: 0, len: None })).await;
    let mut hasher = blake3::Hasher::new();
    let mut n = 0;
    loop {
        match c.conn.recv().await.unwrap().unwrap() {
            Frame::Data(b) => {
                n += b.len();
                hasher.update(&b);
            }
            Frame::Done => break,
            other => panic!("unexpected {}", other.name()),
        }
    }
    assert_eq!(n, data.len());
    assert_eq!(hasher.finalize(), blake3::hash(&data));
}

/// Frames of every size, the first ones in the same segment as the request and the next call
/// right behind `Eof`: silkd reads each header exactly and splices each payload, so every byte
/// lands in order and the call after the write still finds its own bytes.
#[tokio::test]
async fn a_write_in_frames_of_every_size_keeps_every_byte_and_the_next_call() {
    let silkd = Silkd::start();
    let file = silkd.path("mixed.bin");
    let mut c = silkd.connect().await;
    let sizes = [0usize, 1, 7, 4096, 65_537, 262_144, 300_000, 1_000_000, 3, 200_000, 127, 128];
    let mut expected = vec![];
    c.conn
        .queue(&Frame::Write(WriteRequest { path: path_str(&file), mode: None, parents: false }))
        .unwrap();
    for (i, n) in sizes.into_iter().enumerate() {
        let chunk: Vec<u8> = (0..n).map(|j| (j * 31 + i * 7) as u8).collect();
        expected.extend_from_slice(&chunk);
        c.conn.queue(&Frame::Data(Bytes::from(chunk))).unwrap();
    }
    c.conn.queue(&Frame::Eof).unwrap();
    c.conn.queue(&Frame::Stat { path: path_str(&file) }).unwrap();
    c.conn.flush().await.unwrap();
    c.reply().await.done();
    let st = stat_of(&c.reply().await);
    assert_eq!(st.size, expected.len() as u64);
    assert_eq!(blake3::hash(&std::fs::read(&file).unwrap()), blake3::hash(&expected));
    // Another frame inside a write ends it with nothing written; the connection goes on.
    let other = silkd.path("other.bin");
    c.conn
        .queue(&Frame::Write(WriteRequest { path: path_str(&other), mode: None, parents: false }))
        .unwrap();
    c.conn.queue(&Frame::Data(Bytes::from(vec![1; 70_000]))).unwrap();
    let r = c.call(Frame::Info).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::BadRequest), "{:?}", r.end);
    assert!(!other.exists());
    assert_eq!(c.exec(&["true"]).await.exit().code, 0);
}

/// A write that fills its filesystem: `ResourceExhausted`, no temp file left, and the frames
/// the client still sends are dropped whole (the connection stays on a frame boundary).
#[tokio::test]
async fn a_write_that_fills_the_disk_fails_and_the_connection_goes_on() {
    let silkd = Silkd::start();
    let small = silkd.path("small");
    let _mounted = Tmpfs::mount(&small, "size=1m");

    let mut c = silkd.connect().await;
    let r = c.write(&small.join("big.bin"), &vec![7u8; 4 << 20]).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::ResourceExhausted), "{:?}", r.end);
    assert_eq!(std::fs::read_dir(&small).unwrap().count(), 0, "no temp file left");
    assert_eq!(c.exec(&["true"]).await.exit().code, 0);
    c.write(&small.join("fits.bin"), b"fits").await.done();
    assert_eq!(std::fs::read(small.join("fits.bin")).unwrap(), b"fits");
}

/// `Quiesce` from another connection (before a checkpoint) closes a connection in the middle
/// of a write: the write's thread lets go of the socket too, so the client sees the close, and
/// the temp file goes.
#[tokio::test]
async fn a_quiesce_ends_a_write_in_progress() {
    let silkd = Silkd::start();
    let dir = silkd.path("quiet");
    std::fs::create_dir(&dir).unwrap();
    let mut writer = silkd.connect().await;
    writer
        .send(Frame::Write(WriteRequest {
            path: path_str(&dir.join("f")),
            mode: None,
            parents: false,
        }))
        .await;
    writer.send(Frame::Data(Bytes::from(vec![1; 300_000]))).await;
    eventually("the temp file", || std::fs::read_dir(&dir).unwrap().count() == 1).await;
    let mut quiet = silkd.connect().await;
    quiet.call(Frame::Quiesce).await.done();
    let closed = tokio::time::timeout(std::time::Duration::from_secs(20), writer.conn.recv()).await;
    assert!(matches!(closed, Ok(Ok(None) | Err(_))), "the writer's connection closed: {closed:?}");
    eventually("temp file removed", || std::fs::read_dir(&dir).unwrap().count() == 0).await;
}

/// A tmpfs mounted at a new directory (the suite runs as root), unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(at: &std::path::Path, options: &str) -> Tmpfs {
        std::fs::create_dir(at).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs"])
            .arg(at)
            .status()
            .unwrap();
        assert!(mounted.success(), "mount a tmpfs with {options} (the suite runs as root)");
        Tmpfs(at.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// Builds a tar stream of a small tree with the system `tar`, as a client would.
fn tar_of(dir: &std::path::Path) -> Vec<u8> {
    let out = std::process::Command::new("tar")
        .arg("-C")
        .arg(dir)
        .arg("-cf")
        .arg("-")
        .arg(".")
        .output()
        .unwrap();
    assert!(out.status.success());
    out.stdout
}

async fn push(c: &mut Client, dest: &std::path::Path, tar: &[u8], finish: bool) -> Option<Reply> {
    c.send(Frame::Push { path: path_str(dest) }).await;
    for chunk in tar.chunks(10_000) {
        c.send(Frame::Data(Bytes::copy_from_slice(chunk))).await;
    }
    if finish { Some(c.call(Frame::Eof).await) } else { None }
}

#[tokio::test]
async fn push_and_pull_round_trip_a_tree() {
    let silkd = Silkd::start();
    let src = silkd.path("src");
    std::fs::create_dir_all(src.join("a/b")).unwrap();
    std::fs::write(src.join("a/b/f"), b"deep").unwrap();
    std::fs::write(src.join("top"), b"top").unwrap();
    std::fs::set_permissions(src.join("top"), std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink("top", src.join("link")).unwrap();

    let mut c = silkd.connect().await;
    let dest = silkd.path("dest");
    push(&mut c, &dest, &tar_of(&src), true).await.unwrap().done();
    assert_eq!(std::fs::read(dest.join("a/b/f")).unwrap(), b"deep");
    assert_eq!(std::fs::metadata(dest.join("top")).unwrap().permissions().mode() & 0o777, 0o700);
    assert_eq!(std::fs::read_link(dest.join("link")).unwrap().to_str(), Some("top"));

    // Push merges into an existing directory: new files added, existing ones replaced.
    std::fs::write(dest.join("keep"), b"kept").unwrap();
    std::fs::write(src.join("top"), b"top v2").unwrap();
    push(&mut c, &dest, &tar_of(&src), true).await.unwrap().done();
    assert_eq!(std::fs::read(dest.join("keep")).unwrap(), b"kept");
    assert_eq!(std::fs::read(dest.join("top")).unwrap(), b"top v2");

    // Pull gives back a tar stream the system tar extracts to the same tree.
    let r = c.call(Frame::Pull { path: path_str(&dest) }).await;
    r.done();
    let out = silkd.path("out");
    std::fs::create_dir(&out).unwrap();
    let mut tar = std::process::Command::new("tar")
        .arg("-C")
        .arg(&out)
        .arg("-xf")
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    tar.stdin.take().unwrap().write_all(&r.data()).unwrap();
    assert!(tar.wait().unwrap().success());
    assert_eq!(std::fs::read(out.join("a/b/f")).unwrap(), b"deep");
    assert_eq!(std::fs::read(out.join("keep")).unwrap(), b"kept");

    // A single file pulls as a one-entry archive.
    let r = c.call(Frame::Pull { path: path_str(&dest.join("keep")) }).await;
    r.done();
    assert!(r.data().len() >= 1024);
}

#[tokio::test]
async fn a_broken_push_changes_nothing() {
    let silkd = Silkd::start();
    let src = silkd.path("src");
    std::fs::create_dir_all(&src).unwrap();
    for i in 0..50 {
        std::fs::write(src.join(format!("f{i}")), vec![b'z'; 20_000]).unwrap();
    }
    let tar = tar_of(&src);
    let dest = silkd.path("dest");
    std::fs::create_dir(&dest).unwrap();
    std::fs::write(dest.join("f1"), b"original").unwrap();

    // Half the stream, then the client vanishes.
    let mut c = silkd.connect().await;
    push(&mut c, &dest, &tar[..tar.len() / 2], false).await;
    drop(c);
    let staged = |dir: &std::path::Path| {
        std::fs::read_dir(dir)
            .unwrap()
            .any(|e| e.unwrap().file_name().to_string_lossy().starts_with(".silk-push"))
    };
    let parent = silkd.dir.path().to_path_buf();
    eventually("staging removed", || !staged(&parent) && !staged(&dest)).await;
    assert_eq!(std::fs::read_dir(&dest).unwrap().count(), 1);
    assert_eq!(std::fs::read(dest.join("f1")).unwrap(), b"original");

    // Garbage instead of tar: a typed error, nothing changed, connection usable.
    let mut c = silkd.connect().await;
    let r = push(&mut c, &dest, &vec![0x42; 5000], true).await.unwrap();
    assert_eq!(r.error_kind(), Some(ErrorKind::BadRequest));
    assert_eq!(std::fs::read_dir(&dest).unwrap().count(), 1);
    // Cancel mid-stream: nothing changed either.
    push(&mut c, &dest, &tar[..tar.len() / 2], false).await;
    let r = c.call(Frame::Cancel).await;
    assert!(r.error_kind().is_some());
    assert_eq!(std::fs::read(dest.join("f1")).unwrap(), b"original");
    assert_eq!(c.exec(&["true"]).await.exit().code, 0);
}

/// Staging happens on the target's filesystem, so pushing into a mount point (like /tmp in a
/// sandbox) works: the merge is a rename, never a cross-device move.
#[tokio::test]
async fn push_into_a_mount_point() {
    let silkd = Silkd::start();
    let mnt = silkd.path("mnt");
    let mounted = Tmpfs::mount(&mnt, "defaults");
    let src = silkd.path("src");
    std::fs::create_dir_all(src.join("d")).unwrap();
    std::fs::write(src.join("d/f"), b"on tmpfs").unwrap();
    let mut c = silkd.connect().await;
    let r = push(&mut c, &mnt, &tar_of(&src), true).await.unwrap();
    let content = std::fs::read(mnt.join("d/f"));
    let leftovers: Vec<_> =
        std::fs::read_dir(&mnt).unwrap().map(|e| e.unwrap().file_name()).collect();
    drop(mounted);
    r.done();
    assert_eq!(content.unwrap(), b"on tmpfs");
    assert_eq!(leftovers, vec![std::ffi::OsString::from("d")], "no staging left behind");
}
