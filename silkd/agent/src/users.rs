//! User lookup from the sandbox's own `/etc/passwd` and `/etc/group`.
//!
//! Parsed by hand rather than through libc's NSS: silkd is linked statically to run in any
//! rootfs, and static glibc cannot load NSS modules.

use silk_proto::{ErrorKind, WireError};

#[derive(Debug, Clone)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    /// Supplementary groups, primary group included.
    pub groups: Vec<libc::gid_t>,
}

/// Finds `who` (a name or a numeric uid) in `/etc/passwd`.
pub fn lookup(who: &str) -> Result<User, WireError> {
    lookup_in(who, "/etc/passwd", "/etc/group")
}

fn lookup_in(who: &str, passwd: &str, group: &str) -> Result<User, WireError> {
    let passwd = std::fs::read_to_string(passwd).unwrap_or_default();
    let by_uid = who.parse::<u32>().ok();
    let found = passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 {
            return None;
        }
        let uid = f[2].parse::<u32>().ok()?;
        let gid = f[3].parse::<u32>().ok()?;
        (f[0] == who || by_uid == Some(uid)).then(|| User {
            name: f[0].into(),
            uid,
            gid,
            home: f[5].into(),
            groups: vec![gid],
        })
    });
    let mut user = match (found, by_uid) {
        (Some(user), _) => user,
        // A bare uid with no passwd entry is still a valid identity to run as.
        (None, Some(uid)) => {
            User { name: who.into(), uid, gid: uid, home: "/".into(), groups: vec![uid] }
        }
        (None, None) => {
            return Err(WireError::new(
                ErrorKind::BadRequest,
                format!("no user {who:?} in /etc/passwd"),
            ));
        }
    };
    let groups = std::fs::read_to_string(group).unwrap_or_default();
    for line in groups.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() == 4
            && f[3].split(',').any(|m| m == user.name)
            && let Ok(gid) = f[2].parse::<u32>()
            && !user.groups.contains(&gid)
        {
            user.groups.push(gid);
        }
    }
    Ok(user)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_users_by_name_and_uid_with_their_groups() {
        let dir = tempfile::tempdir().unwrap();
        let passwd = dir.path().join("passwd");
        let group = dir.path().join("group");
        std::fs::write(
            &passwd,
            "root:x:0:0:root:/root:/bin/sh\nbob:x:1000:1000::/home/bob:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(&group, "bob:x:1000:\nwheel:x:10:bob,alice\nother:x:11:alice\n").unwrap();
        let (p, g) = (passwd.to_str().unwrap(), group.to_str().unwrap());
        let bob = lookup_in("bob", p, g).unwrap();
        assert_eq!((bob.uid, bob.gid, bob.home.as_str()), (1000, 1000, "/home/bob"));
        assert_eq!(bob.groups, vec![1000, 10]);
        assert_eq!(lookup_in("0", p, g).unwrap().name, "root");
        assert_eq!(lookup_in("4242", p, g).unwrap().uid, 4242);
        assert_eq!(lookup_in("mallory", p, g).unwrap_err().kind, ErrorKind::BadRequest);
    }
}
