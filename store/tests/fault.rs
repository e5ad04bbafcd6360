//! The contract suite through the fault wrapper (which must be transparent when no fault is
//! set), and the faults themselves.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use silk_store::fault::{FaultStore, Op};
use silk_store::{Key, ObjectStore, StoreError};

contract_suite!(common::fault_fs);

#[tokio::test]
async fn faults_fail_the_calls_they_target_and_nothing_else() {
    let inner = common::fs().await;
    let fault = FaultStore::new(inner.store.clone());
    let k = Key::new("chunks/x").unwrap();
    let other = Key::new("objects/y").unwrap();

    fault.fail_next(2);
    for _ in 0..2 {
        let err = fault.put_bytes(&k, Bytes::from_static(b"x")).await.unwrap_err();
        assert!(err.is_retryable(), "an injected outage is retryable: {err}");
    }
    fault.put_bytes(&k, Bytes::from_static(b"x")).await.unwrap();

    fault.fail_keys("^chunks/", Some(Op::Get));
    assert!(matches!(fault.get_bytes(&k).await, Err(StoreError::Unavailable { .. })));
    fault.head(&k).await.unwrap(); // another operation on the key still works
    fault.put_bytes(&other, Bytes::from_static(b"y")).await.unwrap();
    assert_eq!(&fault.get_bytes(&other).await.unwrap()[..], b"y");

    fault.fail_keys("^objects/", None);
    assert!(fault.delete(&[k.clone(), other.clone()]).await.is_err(), "a batch with a match fails");
    fault.clear();
    fault.delete(&[k, other]).await.unwrap();

    let counts = fault.counts();
    assert_eq!(counts.injected, 4);
    assert_eq!((counts.puts, counts.gets, counts.deletes), (2, 1, 1));
    assert_eq!(counts.put_bytes, 2);
    assert!(fault.name().starts_with("fault("));
    let _keep: Arc<dyn ObjectStore> = inner.store;
}

#[tokio::test(start_paused = true)]
async fn latency_delays_every_call() {
    let inner = common::fs().await;
    let fault = FaultStore::new(inner.store.clone());
    fault.set_latency(std::time::Duration::from_secs(30));
    let k = Key::new("slow/x").unwrap();
    // With paused time the 30 s pass instantly, but they pass: the clock says so.
    let t = tokio::time::Instant::now();
    assert!(fault.head(&k).await.unwrap_err().is_not_found());
    assert!(t.elapsed() >= std::time::Duration::from_secs(30));
}
