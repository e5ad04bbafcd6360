//! Credentials for a registry, first found wins:
//! 1. the registry's own section in the node's config: `username`, and the password in the
//!    environment variable `password_env` names (never in the file itself);
//! 2. a docker `config.json`: the configured `auth_file`, else `$REGISTRY_AUTH_FILE`, else
//!    `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json` (its `auths` entries: `auth` as
//!    base64 `user:password`, or `username` and `password`);
//! 3. none: anonymous, which still follows a registry's bearer-token challenge.

use std::path::PathBuf;

use base64::Engine as _;
use oci_client::secrets::RegistryAuth;

use crate::{RegistryError, RegistrySettings, Result};

pub(crate) fn credentials(
    registry: &str,
    settings: Option<&RegistrySettings>,
    auth_file: Option<&PathBuf>,
) -> Result<RegistryAuth> {
    if let Some(s) = settings
        && let Some(user) = &s.username
    {
        let var = s.password_env.as_deref().unwrap_or("SANDBOXD_REGISTRY_PASSWORD");
        let password = std::env::var(var).map_err(|_| RegistryError::Denied {
            registry: registry.into(),
            reason: format!("the password for {user:?} belongs in ${var}, which is not set"),
        })?;
        return Ok(RegistryAuth::Basic(user.clone(), password));
    }
    let Some(path) = docker_config(auth_file) else { return Ok(RegistryAuth::Anonymous) };
    let Ok(text) = std::fs::read(&path) else { return Ok(RegistryAuth::Anonymous) };
    let json: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| RegistryError::Denied {
            registry: registry.into(),
            reason: format!("{}: {e}", path.display()),
        })?;
    let auths = &json["auths"];
    let hub = matches!(registry, "docker.io" | "index.docker.io" | "registry-1.docker.io");
    let names = [
        registry.to_string(),
        format!("https://{registry}"),
        format!("http://{registry}"),
        if hub { "https://index.docker.io/v1/".into() } else { String::new() },
    ];
    let Some(entry) = names.iter().find_map(|n| auths.get(n)) else {
        return Ok(RegistryAuth::Anonymous);
    };
    let text = |k: &str| entry[k].as_str().filter(|s| !s.is_empty()).map(str::to_string);
    if let (Some(user), Some(password)) = (text("username"), text("password")) {
        return Ok(RegistryAuth::Basic(user, password));
    }
    let decoded = text("auth")
        .and_then(|a| base64::engine::general_purpose::STANDARD.decode(a).ok())
        .and_then(|b| String::from_utf8(b).ok());
    match decoded.as_deref().and_then(|d| d.split_once(':')) {
        Some((user, password)) => Ok(RegistryAuth::Basic(user.into(), password.into())),
        None => Ok(RegistryAuth::Anonymous),
    }
}

fn docker_config(configured: Option<&PathBuf>) -> Option<PathBuf> {
    if let Some(p) = configured {
        return Some(p.clone());
    }
    if let Some(p) = std::env::var_os("REGISTRY_AUTH_FILE") {
        return Some(p.into());
    }
    if let Some(dir) = std::env::var_os("DOCKER_CONFIG") {
        return Some(PathBuf::from(dir).join("config.json"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".docker/config.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(a: RegistryAuth) -> Option<(String, String)> {
        match a {
            RegistryAuth::Basic(u, p) => Some((u, p)),
            _ => None,
        }
    }

    #[test]
    fn a_docker_config_json_gives_each_registry_its_own_credentials() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret:with:colons");
        std::fs::write(
            &file,
            format!(
                r#"{{"auths":{{"127.0.0.9:5000":{{"auth":"{auth}"}},"https://ghcr.io":{{"username":"bob","password":"pw"}}}}}}"#
            ),
        )
        .unwrap();
        let got = |r| basic(credentials(r, None, Some(&file)).unwrap());
        assert_eq!(got("127.0.0.9:5000"), Some(("alice".into(), "s3cret:with:colons".into())));
        assert_eq!(got("ghcr.io"), Some(("bob".into(), "pw".into())));
        assert_eq!(got("quay.io"), None, "no entry: anonymous");
    }

    #[test]
    fn a_configured_user_takes_the_password_from_the_named_variable_only() {
        let s = RegistrySettings {
            username: Some("ci".into()),
            password_env: Some("SILK_TEST_REGISTRY_PW_UNSET".into()),
            ..Default::default()
        };
        let err = credentials("r:1", Some(&s), None).unwrap_err();
        assert!(matches!(err, RegistryError::Denied { .. }), "{err}");
    }
}
