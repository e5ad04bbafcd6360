//! The template routes: list and look up (built in, configured, promoted, registered), register
//! a registry image on the fleet, refresh a registry template's pin, delete.
//!
//! Root sees and manages every template. A tenant sees root's (bare names) and its own
//! (`<tenant>/…`), registers under its own prefix, and changes only its own; anyone else's
//! answers the same 404 as an unknown name.

use silk_api::{PullStatus, Template, TemplateKind};

use super::*;

pub(super) fn promoted_row(name: &str, p: &crate::node::Promoted) -> Template {
    Template {
        digest: Some(p.golden.digest.to_string()),
        source: Some(p.source.clone()),
        created_ms: Some(p.created_ms),
        ..listed(name, TemplateKind::Promoted)
    }
}

/// Whether a caller of `scope` (none: root) sees template `name`.
pub(super) fn visible(name: &str, scope: Option<&str>) -> bool {
    match (scope, name.split_once('/')) {
        (None, _) | (Some(_), None) => true,
        (Some(t), Some((owner, _))) => owner == t,
    }
}

/// Whether a caller of `scope` may change template `name`: root any, a tenant its own.
fn owns(name: &str, scope: Option<&str>) -> bool {
    scope.is_none() || name.contains('/') && visible(name, scope)
}

fn listed(name: &str, kind: TemplateKind) -> Template {
    Template {
        name: name.into(),
        kind,
        digest: None,
        source: None,
        created_ms: None,
        image: None,
        image_digest: None,
        status: None,
        bytes_done: None,
        bytes_total: None,
        error: None,
    }
}

/// A template from a registry image, with its pull as this node sees it.
fn image_row(node: &Node, row: Template, image: String, digest: Option<String>) -> Template {
    let view = digest.as_deref().map(|d| node.images.view(&row.name, d));
    Template {
        image: Some(image),
        image_digest: digest,
        status: Some(view.as_ref().map_or(PullStatus::Pending, |v| v.status)),
        bytes_done: view.as_ref().and_then(|v| v.done),
        bytes_total: view.as_ref().and_then(|v| v.total),
        error: view.and_then(|v| v.error),
        ..row
    }
}

fn configured_row(node: &Node, name: &str) -> Template {
    let row = listed(name, TemplateKind::Configured);
    match node.cfg.templates.get(name).and_then(|t| t.reference.clone()) {
        Some(image) => {
            let digest = node.images.pinned(name, &image);
            image_row(node, row, image, digest)
        }
        None => row,
    }
}

fn registered_row(node: &Node, r: crate::images::Registered) -> Template {
    let row =
        Template { created_ms: Some(r.created_ms), ..listed(&r.name, TemplateKind::Registered) };
    image_row(node, row, r.image, Some(r.digest))
}

fn not_found(name: &str) -> NodeError {
    NodeError::new(Code::TemplateNotFound, format!("no template {name:?}"))
}

/// Template `name` as a caller of `scope` sees it.
fn find(node: &Node, name: &str, scope: Option<&str>) -> Result<Template, NodeError> {
    if !visible(name, scope) {
        return Err(not_found(name));
    }
    if name == "host" {
        return Ok(listed("host", TemplateKind::Builtin));
    }
    if node.cfg.templates.contains_key(name) {
        return Ok(configured_row(node, name));
    }
    if let Some(p) = node.promoted().get(name) {
        return Ok(promoted_row(name, p));
    }
    match node.images.registered(name) {
        Some(r) => Ok(registered_row(node, r)),
        None => Err(not_found(name)),
    }
}

pub(super) async fn list(
    State(node): Shared,
    headers: HeaderMap,
) -> Result<axum::Json<silk_api::TemplateList>, NodeError> {
    let scope = node.principal(bearer(&headers)).scope()?;
    let scope = scope.as_deref();
    let mut templates = vec![listed("host", TemplateKind::Builtin)];
    templates.extend(node.cfg.templates.keys().map(|n| configured_row(&node, n)));
    let promoted = node.promoted();
    let promoted = promoted.iter().filter(|(n, _)| visible(n, scope));
    templates.extend(promoted.map(|(n, p)| promoted_row(n, p)));
    let registered = node.images.all_registered().into_iter().filter(|r| visible(&r.name, scope));
    templates.extend(registered.map(|r| registered_row(&node, r)));
    Ok(axum::Json(silk_api::TemplateList { templates }))
}

pub(super) async fn get(
    State(node): Shared,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<axum::Json<Template>, NodeError> {
    let scope = node.principal(bearer(&headers)).scope()?;
    Ok(axum::Json(find(&node, &name, scope.as_deref())?))
}

pub(super) async fn register(
    State(node): Shared,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
    JsonBody(req): JsonBody<silk_api::RegisterTemplate>,
) -> Result<Response, NodeError> {
    let scope = node.principal(bearer(&headers)).scope()?;
    // `?wait=true`: answer when the pull on this node has ended (`201`, or its error), not at
    // once (`202`).
    let wait = flag(query.as_deref(), "wait")?;
    let n = node.clone();
    let record = detached(async move { n.register_template(req, scope.as_deref()).await }).await?;
    let name = record.name.clone();
    if wait {
        let n = node.clone();
        let pulled = name.clone();
        detached(async move { n.template_ready(&pulled).await }).await?;
        let row = registered_row(&node, record);
        return Ok((StatusCode::CREATED, axum::Json(row)).into_response());
    }
    Ok((StatusCode::ACCEPTED, axum::Json(registered_row(&node, record))).into_response())
}

pub(super) async fn refresh(
    State(node): Shared,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<axum::Json<Template>, NodeError> {
    let scope = node.principal(bearer(&headers)).scope()?;
    if !owns(&name, scope.as_deref()) {
        return Err(not_found(&name));
    }
    let n = node.clone();
    let refreshed = name.clone();
    detached(async move { n.refresh_template(&refreshed).await }).await?;
    Ok(axum::Json(find(&node, &name, scope.as_deref())?))
}

pub(super) async fn delete(
    State(node): Shared,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<StatusCode, NodeError> {
    let scope = node.principal(bearer(&headers)).scope()?;
    if !owns(&name, scope.as_deref()) {
        return Err(not_found(&name));
    }
    if node.images.registered(&name).is_some() {
        let n = node.clone();
        detached(async move { n.unregister_template(&name).await }).await?;
    } else {
        node.delete_template(&name)?;
    }
    Ok(StatusCode::NO_CONTENT)
}
