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
