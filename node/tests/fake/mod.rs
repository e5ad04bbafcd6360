//! Harness for the controller's tests on the fake engine: a node on a runtime of its own, so
//! dropping the runtime stops every task at once, as `kill -9` stops the process.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sandboxd::claims::{ClaimSpec, OnExpire};
use sandboxd::config::Config;
use sandboxd::node::Node;
use sandboxd::pool::PoolKey;
use silk_engine::fake::FakeEngine;
use silk_engine::{Engine, Lane, SandboxId, Size};

pub struct Harness {
    pub dir: tempfile::TempDir,
    pub engine: Arc<FakeEngine>,
}

impl Harness {
    pub fn new() -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let engine = Arc::new(FakeEngine::new(dir.path().join("fake")));
        Harness { dir, engine }
    }

    pub fn config(&self, warm: usize) -> Config {
        let mut cfg = Config { data_dir: self.dir.path().join("data"), ..Config::default() };
        cfg.min_free_mib = 0;
        cfg.pools[0].warm = warm;
        cfg.pools[0].warm_max = Some(warm);
        cfg
    }

    /// A node on its own runtime: the pair goes together.
    pub fn open(&self, cfg: Config) -> (tokio::runtime::Runtime, Arc<Node>) {
        self.open_in_fleet(cfg, None)
    }

    /// [`open`](Self::open) with other nodes to reach (a move's target).
    pub fn open_in_fleet(
        &self,
        cfg: Config,
        fleet: Option<Arc<dyn sandboxd::node::fleet::Fleet>>,
    ) -> (tokio::runtime::Runtime, Arc<Node>) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let engine: Arc<dyn Engine> = self.engine.clone();
        let node = rt.block_on(Node::open(cfg, engine)).unwrap();
        if let Some(fleet) = fleet {
            let _in_runtime = rt.enter();
            node.join(fleet);
        }
        (rt, node)
    }
}

pub fn spec(ttl_seconds: u64) -> ClaimSpec {
    ClaimSpec {
        template: "host".into(),
        size: Size::Small,
        lane: Lane::None,
        ttl_seconds,
        metadata: BTreeMap::new(),
        on_expire: OnExpire::Destroy,
        tenant: None,
        egress: None,
    }
}

pub fn sid(id: &str) -> SandboxId {
    id.parse().unwrap()
}

pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("timed out waiting until {what}");
}

pub fn host_pool() -> PoolKey {
    PoolKey { template: "host".into(), size: Size::Small, lane: Lane::None }
}
