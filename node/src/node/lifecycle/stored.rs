//! The description of a snapshot kept in its manifest (see [`StoredSnapshot`]).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use silk_engine::{Base, BoxSpec, Digest, Lane, Size, Snapshot};

/// What a snapshot's manifest says about it, under the metadata key `snapshot`: names, digests,
/// size and lane, nothing else. The store is shared by every node (and whoever else can write
/// to it), so nothing read from it may name a path on this node or set a sandbox's limits: a
/// download builds the engine's [`Snapshot`] here from these fields ([`StoredSnapshot::local`]),
/// the template and golden resolved on this node by name and digest (`local_base`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StoredSnapshot {
    pub(super) template: String,
    pub(super) template_digest: Digest,
    pub(super) golden: Option<Digest>,
    pub(super) size: Size,
    pub(super) lane: Lane,
}

impl StoredSnapshot {
    pub(super) fn of(snap: &Snapshot) -> StoredSnapshot {
        StoredSnapshot::over(&snap.base, &snap.spec)
    }

    /// The files of a box with `spec` over `base`.
    pub(super) fn over(base: &Base, spec: &BoxSpec) -> StoredSnapshot {
        StoredSnapshot {
            template: base.template.name.clone(),
            template_digest: base.template.digest.clone(),
            golden: base.golden.as_ref().map(|g| g.digest.clone()),
            size: spec.size,
            lane: spec.lane,
        }
    }

    /// Parses the metadata. Manifests written before this type held the engine's whole
    /// `Snapshot` as JSON: from those only the same five fields are taken (never a path, the
    /// limits or the memory flag), so their checkpoints and archives still restore.
    pub(super) fn parse(json: &str) -> Result<StoredSnapshot, String> {
        let err = match serde_json::from_str::<StoredSnapshot>(json) {
            Ok(s) => return Ok(s),
            Err(e) => e.to_string(),
        };
        let v: serde_json::Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
        let old = || -> Option<StoredSnapshot> {
            let at = |p: &str| v.pointer(p).cloned();
            let golden = match v.pointer("/base/golden")? {
                serde_json::Value::Null => None,
                g => Some(serde_json::from_value(g.get("digest")?.clone()).ok()?),
            };
            Some(StoredSnapshot {
                template: v.pointer("/base/template/name")?.as_str()?.to_string(),
                template_digest: serde_json::from_value(at("/base/template/digest")?).ok()?,
                golden,
                size: serde_json::from_value(at("/spec/size")?).ok()?,
                lane: serde_json::from_value(at("/spec/lane")?).ok()?,
            })
        };
        old().ok_or(err)
    }

    /// The engine's snapshot of these files on this node: `base` resolved here, the tar at
    /// `layer_tar`, a spec of size and lane only (the node's own limits for them), no memory.
    pub(super) fn local(&self, base: Base, layer_tar: PathBuf, bytes: u64) -> Snapshot {
        let spec = BoxSpec::new(self.size, self.lane);
        Snapshot {
            base,
            spec,
            layer_tar,
            bytes,
            memory: false,
            memory_why_not: None,
            freeze_ms: None,
            vouched: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use silk_engine::Golden;

    fn digest(c: char) -> Digest {
        c.to_string().repeat(64).parse().unwrap()
    }

    fn template(root: &str) -> silk_engine::Template {
        silk_engine::Template {
            name: "host".into(),
            digest: digest('a'),
            root: root.into(),
            binds: vec![(root.into(), "/x".into())],
            env: vec![],
            cwd: None,
            user: None,
        }
    }

    /// A snapshot as another node (or whoever writes to the store) might describe it.
    fn foreign_snapshot() -> Snapshot {
        let golden =
            Golden { digest: digest('b'), template: template("/etc"), layer: "/root".into() };
        let limits = silk_engine::Limits { cpu_millis: u32::MAX, memory_bytes: u64::MAX, pids: 0 };
        Snapshot {
            base: Base { template: template("/etc"), golden: Some(golden) },
            spec: BoxSpec { size: Size::Large, lane: Lane::Egress, limits: Some(limits) },
            layer_tar: "/etc/shadow".into(),
            bytes: 1,
            memory: true,
            memory_why_not: None,
            freeze_ms: None,
            vouched: false,
        }
    }

    #[test]
    fn stored_snapshots_carry_names_and_digests_only() {
        let snap = foreign_snapshot();
        let want = StoredSnapshot {
            template: "host".into(),
            template_digest: digest('a'),
            golden: Some(digest('b')),
            size: Size::Large,
            lane: Lane::Egress,
        };
        let json = serde_json::to_string(&StoredSnapshot::of(&snap)).unwrap();
        assert!(!json.contains('/'), "no path is written to the store: {json}");
        assert_eq!(StoredSnapshot::parse(&json).unwrap(), want);
        // A manifest written before: the whole engine snapshot. Only the same fields are used.
        let old = serde_json::to_string(&snap).unwrap();
        assert_eq!(StoredSnapshot::parse(&old).unwrap(), want);
        // The snapshot restored here: this node's base and tar, no limits, no memory.
        let here = Base { template: template("/data/templates/host-1/root"), golden: None };
        let local = want.local(here.clone(), "/data/scratch/download-1.tar".into(), 7);
        assert_eq!(local.base, here);
        assert_eq!(local.spec, BoxSpec::new(Size::Large, Lane::Egress));
        assert_eq!(local.layer_tar, PathBuf::from("/data/scratch/download-1.tar"));
        assert_eq!(local.bytes, 7);
        assert!(!local.memory);
        // Anything more, or a digest that is not one, is refused.
        let extra = json.replacen('{', r#"{"layer_tar":"/etc/shadow","#, 1);
        assert!(StoredSnapshot::parse(&extra).is_err(), "{extra}");
        for bad in [&json, &old] {
            let bad = bad.replace(digest('b').as_str(), "../../../../etc");
            assert!(StoredSnapshot::parse(&bad).is_err(), "{bad}");
        }
        assert!(StoredSnapshot::parse("{}").is_err());
        assert!(StoredSnapshot::parse("not json").is_err());
    }
}
