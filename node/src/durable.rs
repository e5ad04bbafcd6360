//! Side files (pools, promoted templates, the mesh epoch, known peers) replaced whole: a crash
//! leaves the old file or the new one, and once the call returns a power loss keeps the new one.

use std::io::Write;
use std::path::Path;

/// Writes `bytes` beside `path`, syncs them, renames them over `path`, and syncs the directory
/// (without that, the rename itself may not survive a power loss).
pub fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    #[test]
    fn replaces_the_whole_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pools.json");
        super::replace(&path, b"a much longer first version").unwrap();
        super::replace(&path, b"second").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }
}
