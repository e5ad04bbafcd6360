//! The contract suite on the `fs` backend, and what only a directory can show: staged writes
//! that vanish, keys that stay inside the root, two stores sharing one root.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use silk_store::fs::{FsConfig, FsStore};
use silk_store::{Key, ObjectStore};

contract_suite!(common::fs);

fn tmp_files(root: &std::path::Path) -> usize {
    std::fs::read_dir(root.join(".tmp")).unwrap().count()
}

#[tokio::test]
async fn objects_are_files_under_the_root_and_staging_is_cleaned() {
    let dir = tempfile::tempdir().unwrap();
    let store = FsStore::open(FsConfig::new(dir.path())).await.unwrap();
    let k = Key::new("goldens/pool/abc").unwrap();
    store.put_bytes(&k, Bytes::from_static(b"golden")).await.unwrap();
    assert_eq!(std::fs::read(dir.path().join("goldens/pool/abc")).unwrap(), b"golden");
    assert_eq!(tmp_files(dir.path()), 0, "a finished put leaves no temp file");
    // The staging directory is not an object and cannot be named by a key.
    assert!(Key::new(".tmp/x").is_err());
    assert!(store.list_all("").await.unwrap().iter().all(|o| !o.key.as_str().contains(".tmp")));
    // A failed body (an error from the caller's stream) leaves neither object nor temp file.
    let bad: silk_store::ByteStream = Box::pin(futures_util::stream::iter(vec![
        Ok(Bytes::from_static(b"part")),
        Err(silk_store::StoreError::InvalidConfig("the source failed".into())),
    ]));
    let k2 = Key::new("checkpoints/ck_bad").unwrap();
    assert!(store.put(&k2, bad).await.is_err());
    assert!(!dir.path().join("checkpoints/ck_bad").exists());
    assert_eq!(tmp_files(dir.path()), 0, "a failed put leaves no temp file");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_on_one_root_write_one_key_safely() {
    let dir = tempfile::tempdir().unwrap();
    let a: Arc<dyn ObjectStore> = Arc::new(FsStore::open(FsConfig::new(dir.path())).await.unwrap());
    let b: Arc<dyn ObjectStore> = Arc::new(FsStore::open(FsConfig::new(dir.path())).await.unwrap());
    let data = Bytes::from(common::noise(3, 2 << 20));
    let k = Key::new("chunks/shared").unwrap();
    let mut tasks = Vec::new();
    for i in 0..16 {
        let (s, k, d) = (if i % 2 == 0 { a.clone() } else { b.clone() }, k.clone(), data.clone());
        tasks.push(tokio::spawn(async move { s.put_bytes(&k, d).await }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(a.get_bytes(&k).await.unwrap(), data);
    assert_eq!(tmp_files(dir.path()), 0);
}

/// The root may be shared with other nodes, which can plant symlinks (and FIFOs) in it. Every
/// operation refuses them, says so (`Refused`), and reads, writes and deletes nothing outside.
#[tokio::test]
async fn symlinks_in_the_root_are_refused_never_followed() {
    use std::os::unix::fs::symlink;
    use std::time::{Duration, SystemTime};

    let k = |s: &str| Key::new(s).unwrap();
    let bytes = || Bytes::from_static(b"planted?");

    let dir = tempfile::tempdir().unwrap();
    let (root, outside) = (dir.path().join("store"), dir.path().join("outside"));
    std::fs::create_dir_all(outside.join("sub")).unwrap();
    std::fs::write(outside.join("secret"), b"secret").unwrap();
    std::fs::write(outside.join("sub/obj"), b"object").unwrap();
    // Old enough for the sweep of stale staged files, were `.tmp` followed.
    let stale = std::fs::File::create(outside.join("stale")).unwrap();
    stale.set_modified(SystemTime::now() - Duration::from_secs(7200)).unwrap();
    drop(stale);
    let secret_mtime = || std::fs::metadata(outside.join("secret")).unwrap().modified().unwrap();
    let (mtime_before, tree_before) = (secret_mtime(), tree(&outside));

    // `.tmp` a symlink when the store opens: refused, and nothing it points to is swept.
    std::fs::create_dir_all(&root).unwrap();
    symlink(&outside, root.join(".tmp")).unwrap();
    refused(FsStore::open(FsConfig::new(&root)).await, "open with .tmp a symlink");
    assert!(outside.join("stale").exists(), "the sweep followed .tmp");
    std::fs::remove_file(root.join(".tmp")).unwrap();
    let store = FsStore::open(FsConfig::new(&root)).await.unwrap();

    // `.tmp` swapped for a symlink later: puts refuse to stage through it.
    std::fs::remove_dir(root.join(".tmp")).unwrap();
    symlink(&outside, root.join(".tmp")).unwrap();
    refused(store.put_bytes(&k("a"), bytes()).await, "put_bytes staging through a link");
    refused(store.put(&k("a"), silk_store::stream_of(bytes())).await, "put staging through a link");
    std::fs::remove_file(root.join(".tmp")).unwrap();
    std::fs::create_dir(root.join(".tmp")).unwrap();

    // A directory on a key's way that is a symlink out of the root.
    symlink(&outside, root.join("chunks")).unwrap();
    for key in ["chunks/secret", "chunks/sub/obj"] {
        refused(store.get_bytes(&k(key)).await, key);
        refused(store.get(&k(key), None).await, key);
        refused(store.head(&k(key)).await, key);
        refused(store.touch(&k(key)).await, key);
        refused(store.delete(&[k(key)]).await, key);
    }
    refused(store.put_bytes(&k("chunks/new"), bytes()).await, "put through a link");
    refused(store.put_bytes(&k("chunks/sub/new"), bytes()).await, "put through a link");
    refused(store.list("chunks/", None).await, "list through a link");
    refused(store.list("chunks/sub/", None).await, "list through a link");
    let all = store.list_all("").await.unwrap();
    assert!(all.is_empty(), "a listing followed the link: {all:?}");

    // A symlink at a key.
    std::fs::create_dir(root.join("goldens")).unwrap();
    symlink(outside.join("secret"), root.join("goldens/key")).unwrap();
    let key = k("goldens/key");
    refused(store.get_bytes(&key).await, "get of a link");
    refused(store.get(&key, None).await, "get of a link");
    refused(store.head(&key).await, "head of a link");
    refused(store.touch(&key).await, "touch of a link");
    refused(store.delete(std::slice::from_ref(&key)).await, "delete of a link");
    refused(store.put_bytes(&key, bytes()).await, "put over a link");
    assert!(store.list_all("goldens/").await.unwrap().is_empty());
    assert!(std::fs::symlink_metadata(root.join("goldens/key")).unwrap().file_type().is_symlink());

    // Not a regular file at a key: a socket, and a FIFO (whose open would block the thread).
    let _socket = std::os::unix::net::UnixListener::bind(root.join("goldens/socket")).unwrap();
    refused(store.get_bytes(&k("goldens/socket")).await, "get of a socket");
    let fifo = root.join("goldens/fifo");
    if std::process::Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success()) {
        let key = k("goldens/fifo");
        let Ok(got) = tokio::time::timeout(Duration::from_secs(5), store.get_bytes(&key)).await
        else {
            // Free the blocked reader, then fail.
            let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
            panic!("a get of a FIFO blocked");
        };
        refused(got, "get of a FIFO");
        refused(store.head(&key).await, "head of a FIFO");
    }

    // Nothing outside was read into an object, written, touched or deleted.
    assert_eq!(tree(&outside), tree_before);
    assert_eq!(std::fs::read(outside.join("secret")).unwrap(), b"secret");
    assert_eq!(std::fs::read(outside.join("sub/obj")).unwrap(), b"object");
    assert_eq!(secret_mtime(), mtime_before, "touch went through the link");
}

fn refused<T>(r: Result<T, silk_store::StoreError>, what: &str) {
    match r {
        Err(silk_store::StoreError::Refused { .. }) => {}
        Err(e) => panic!("{what}: {e}, not refused"),
        Ok(_) => panic!("{what}: it succeeded"),
    }
}

/// Every path under `dir`, sorted, without following links.
fn tree(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        out.push(e.path());
        if e.file_type().unwrap().is_dir() {
            out.extend(tree(&e.path()));
        }
    }
    out.sort();
    out
}
