//! Lane tables whose node is gone for good. A node's table outlives the node on purpose: a
//! node killed with its sandboxes running leaves the table that still fences them in, and its
//! next start replaces it. A node whose data directory was deleted after it died (a throwaway
//! node, a test, a killed bench) never starts again, and every packet of the host then walks
//! its table's chains for as long as the host runs.
//!
//! So each node registers its table under [`REGISTRY`] (on a tmpfs: it goes with a reboot, as
//! the tables do), with its interface prefix and its data directory, and a starting node
//! removes each registered table whose data directory is gone and which no interface of the
//! table's prefix uses: no sandbox is left for it to fence. Tables made before this registry
//! are not known to it.

use std::io;
use std::path::{Path, PathBuf};

/// Where nodes register their tables.
pub const REGISTRY: &str = "/run/silkmesh/egress-tables";

/// Registers `table` (for interfaces `prefix*`) as the table of the node on `data_dir`.
pub fn register(registry: &Path, table: &str, prefix: &str, data_dir: &Path) -> io::Result<()> {
    std::fs::create_dir_all(registry)?;
    let entry = format!("{prefix}\n{}", data_dir.display());
    let tmp = registry.join(format!(".{table}.{}", std::process::id()));
    std::fs::write(&tmp, entry)?;
    std::fs::rename(&tmp, registry.join(table))
}

/// Forgets `table` (its node removed it: `sandboxd clean`).
pub fn unregister(registry: &Path, table: &str) {
    let _ = std::fs::remove_file(registry.join(table));
}

/// Removes the registered tables whose node is gone for good (see the module docs); returns
/// their names. An entry that does not parse is left alone.
pub fn sweep(registry: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(registry) else { return vec![] };
    let in_use = interfaces();
    let mut removed = vec![];
    for entry in entries.flatten() {
        let table = entry.file_name().to_string_lossy().into_owned();
        let Some((prefix, data_dir)) =
            std::fs::read_to_string(entry.path()).ok().and_then(|s| parse(&table, &s))
        else {
            continue;
        };
        if data_dir.exists() || in_use.iter().any(|i| i.starts_with(&prefix)) {
            continue;
        }
        if crate::nft::remove(&table).is_ok() {
            unregister(registry, &table);
            removed.push(table);
        }
    }
    removed
}

/// An entry's prefix and data directory, if `table` and the prefix are names a node makes
/// (the names go to `nft`: nothing else is passed on).
fn parse(table: &str, entry: &str) -> Option<(String, PathBuf)> {
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let (prefix, data_dir) = entry.split_once('\n')?;
    let ours = table.strip_prefix("silkmesh_").is_some_and(|h| hex(h, 12))
        && prefix.strip_prefix(crate::IFNAME_PREFIX).is_some_and(|h| hex(h, 5));
    (ours && !data_dir.is_empty()).then(|| (prefix.to_string(), PathBuf::from(data_dir)))
}

/// The names of this network namespace's interfaces.
fn interfaces() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/sys/class/net") else { return vec![] };
    dir.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_entries_naming_a_nodes_table_and_prefix_parse() {
        let t = "silkmesh_0123456789ab";
        assert_eq!(parse(t, "sm01234\n/d/x"), Some(("sm01234".into(), "/d/x".into())));
        assert_eq!(
            parse(t, "sm01234\n/d/with\nnewline"),
            Some(("sm01234".into(), "/d/with\nnewline".into()))
        );
        for (table, entry) in [
            ("silkmesh_0123456789ab", "sm01234"),
            ("silkmesh_0123456789ab", "sm01234\n"),
            ("silkmesh_0123456789ab", "eth0\n/d"),
            ("silkmesh_0123456789ab", "sm0123;\n/d"),
            ("filter", "sm01234\n/d"),
            ("silkmesh_0123; flush ruleset", "sm01234\n/d"),
        ] {
            assert_eq!(parse(table, entry), None, "{table:?} {entry:?}");
        }
    }
}
