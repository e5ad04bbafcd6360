//! Egress policies: which names a sandbox may resolve and which networks it may reach without
//! one. Pure: the resolver and the proxy ask it; the node checks a claim's policy against its
//! pool's with [`Policy::narrows`].

use std::net::Ipv4Addr;

use silk_api::EgressPolicy;

use crate::guard::Net;

/// One `allow` or `deny` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Pattern {
    /// `*`: every name.
    Any,
    /// `example.com`.
    Name(String),
    /// `*.example.com`: names under `example.com` (the suffix kept with its leading dot).
    Under(String),
    /// `203.0.113.0/24` (or one address): connections to these addresses, no name needed.
    Net(Net),
}

impl Pattern {
    fn parse(text: &str) -> Result<Pattern, String> {
        if text == "*" {
            return Ok(Pattern::Any);
        }
        if text.starts_with(|c: char| c.is_ascii_digit())
            && text.contains(['.', '/'])
            && text.bytes().all(|b| b.is_ascii_digit() || b == b'.' || b == b'/')
        {
            return Net::parse(text).map(Pattern::Net);
        }
        let (under, name) = match text.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let name = normalise(name)
            .ok_or_else(|| format!("{text:?} is not a name, *.name, * or an IPv4 network"))?;
        Ok(if under { Pattern::Under(format!(".{name}")) } else { Pattern::Name(name) })
    }

    fn matches(&self, name: &str) -> bool {
        match self {
            Pattern::Any => true,
            Pattern::Name(n) => n == name,
            Pattern::Under(suffix) => name.len() > suffix.len() && name.ends_with(suffix.as_str()),
            Pattern::Net(_) => false,
        }
    }

    /// Whether everything `other` lets through, this does.
    fn covers(&self, other: &Pattern) -> bool {
        match (self, other) {
            (Pattern::Any, Pattern::Net(_)) => false,
            (Pattern::Any, _) => true,
            (Pattern::Net(a), Pattern::Net(b)) => a.contains_net(b),
            (Pattern::Under(s), Pattern::Under(o)) => o.ends_with(s.as_str()),
            (Pattern::Under(_) | Pattern::Name(_), Pattern::Name(n)) => self.matches(n),
            _ => false,
        }
    }
}

/// A name as the resolver compares it: lower case, no trailing dot, DNS's syntax (labels of
/// 1–63 letters, digits, `-` or `_`, at most 253 bytes).
pub fn normalise(name: &str) -> Option<String> {
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    (!name.is_empty() && name.len() <= 253 && name.split('.').all(label_ok)).then_some(name)
}

/// A checked policy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy {
    allow: Vec<Pattern>,
    deny: Vec<Pattern>,
}

/// How many entries a policy may have, each list.
const MAX_ENTRIES: usize = 256;

impl Policy {
    /// Allows nothing: the lane's policy when none is configured anywhere.
    pub fn nothing() -> Policy {
        Policy::default()
    }

    pub fn parse(p: &EgressPolicy) -> Result<Policy, String> {
        let list = |l: &[String], what: &str| {
            if l.len() > MAX_ENTRIES {
                return Err(format!("egress.{what} has more than {MAX_ENTRIES} entries"));
            }
            l.iter().map(|t| Pattern::parse(t).map_err(|e| format!("egress.{what}: {e}"))).collect()
        };
        Ok(Policy { allow: list(&p.allow, "allow")?, deny: list(&p.deny, "deny")? })
    }

    /// Whether the resolver answers `name` (normalised).
    pub fn allows_name(&self, name: &str) -> bool {
        self.allow.iter().any(|p| p.matches(name)) && !self.deny.iter().any(|p| p.matches(name))
    }

    /// Whether the policy lets a connection to `ip` through without a name resolved for it.
    pub fn allows_net(&self, ip: Ipv4Addr) -> bool {
        let hit = |l: &[Pattern]| l.iter().any(|p| matches!(p, Pattern::Net(n) if n.contains(ip)));
        hit(&self.allow) && !hit(&self.deny)
    }

    /// The policy of a claim that asks for `asked` in a pool of this policy: its `allow`
    /// (this one's when it names none) each within one of this one's, the denials of both.
    /// `Err` names an entry that would widen it.
    pub fn narrowed(&self, asked: &Policy) -> Result<Policy, String> {
        let allow = if asked.allow.is_empty() { self.allow.clone() } else { asked.allow.clone() };
        if let Some(wider) = allow.iter().find(|a| !self.allow.iter().any(|p| p.covers(a))) {
            return Err(format!(
                "egress.allow entry {} is not within the pool's policy",
                show(wider)
            ));
        }
        let mut deny = self.deny.clone();
        deny.extend(asked.deny.iter().filter(|d| !self.deny.contains(d)).cloned());
        Ok(Policy { allow, deny })
    }

    /// The wire form.
    pub fn to_api(&self) -> EgressPolicy {
        EgressPolicy {
            allow: self.allow.iter().map(show).collect(),
            deny: self.deny.iter().map(show).collect(),
        }
    }
}

fn show(p: &Pattern) -> String {
    match p {
        Pattern::Any => "*".into(),
        Pattern::Name(n) => n.clone(),
        Pattern::Under(s) => format!("*{s}"),
        Pattern::Net(n) => n.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str], deny: &[&str]) -> Policy {
        let s = |l: &[&str]| l.iter().map(|x| x.to_string()).collect();
        Policy::parse(&EgressPolicy { allow: s(allow), deny: s(deny) }).unwrap()
    }

    #[test]
    fn names_match_exactly_under_or_any_and_deny_wins() {
        let p = policy(&["pypi.org", "*.pythonhosted.org", "github.com"], &["evil.github.com"]);
        assert!(p.allows_name("pypi.org"));
        assert!(!p.allows_name("www.pypi.org"));
        assert!(p.allows_name("files.pythonhosted.org"));
        assert!(!p.allows_name("pythonhosted.org"));
        assert!(!p.allows_name("xpythonhosted.org"));
        assert!(p.allows_name("github.com"));
        let any = policy(&["*"], &["*.internal", "evil.com"]);
        assert!(any.allows_name("anything.example"));
        assert!(!any.allows_name("db.internal"));
        assert!(!any.allows_name("evil.com"));
        assert!(!Policy::nothing().allows_name("pypi.org"));
    }

    #[test]
    fn names_are_normalised_and_bad_entries_refused() {
        assert_eq!(normalise("PyPI.org."), Some("pypi.org".into()));
        assert_eq!(normalise("a..b"), None);
        assert_eq!(normalise(&"a".repeat(64)), None);
        assert_eq!(policy(&["PyPI.Org."], &[]).to_api().allow, ["pypi.org"]);
        for bad in ["", "*.", "a.*.b", "**", "exa mple.com", "10.0.0.0/33", "1.2.3.4/"] {
            let p = EgressPolicy { allow: vec![bad.into()], deny: vec![] };
            assert!(Policy::parse(&p).is_err(), "{bad:?} accepted");
        }
        let long = EgressPolicy { allow: vec!["a.com".into(); 257], deny: vec![] };
        assert!(Policy::parse(&long).is_err());
    }

    #[test]
    fn networks_allow_addresses_without_names() {
        let p = policy(&["203.0.113.0/24", "198.51.100.7"], &["203.0.113.9"]);
        assert!(p.allows_net("203.0.113.8".parse().unwrap()));
        assert!(!p.allows_net("203.0.113.9".parse().unwrap()));
        assert!(p.allows_net("198.51.100.7".parse().unwrap()));
        assert!(!p.allows_net("198.51.100.8".parse().unwrap()));
        assert!(!policy(&["*"], &[]).allows_net("198.51.100.8".parse().unwrap()));
    }

    #[test]
    fn a_claim_may_only_narrow_its_pool() {
        let pool = policy(&["*.example.com", "pypi.org", "203.0.113.0/24"], &["bad.example.com"]);
        let ok = pool
            .narrowed(&policy(&["a.example.com", "*.b.example.com", "203.0.113.16/28"], &["x.org"]))
            .unwrap();
        assert_eq!(ok.to_api().deny, ["bad.example.com", "x.org"]);
        assert!(!ok.allows_name("bad.example.com"), "the pool's denials stay");
        // Nothing asked: the pool's allow list.
        assert_eq!(pool.narrowed(&Policy::nothing()).unwrap().allow, pool.allow);
        for wider in [&["*"][..], &["example.com"], &["*.com"], &["github.com"], &["203.0.0.0/16"]]
        {
            assert!(pool.narrowed(&policy(wider, &[])).is_err(), "{wider:?} widened");
        }
        let everything = policy(&["*"], &[]);
        assert!(everything.narrowed(&policy(&["pypi.org"], &[])).is_ok());
        assert!(everything.narrowed(&policy(&["10.0.0.0/8"], &[])).is_err(), "* is names only");
    }
}
