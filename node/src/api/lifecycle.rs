//! The lifecycle routes: hibernate, wake, archive, checkpoints and branches, fork, promote and
//! templates, move.

use super::*;

pub(super) async fn hibernate(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let n = node.clone();
    let record = detached(async move { n.hibernate(&id).await }).await?;
    Ok(axum::Json(row(&node, &record)))
}

pub(super) async fn wake(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let n = node.clone();
    let live = detached(async move { n.wake(&id).await }).await?;
    Ok(axum::Json(row(&node, &live.record)))
}

pub(super) async fn archive(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let n = node.clone();
    let record = detached(async move { n.archive(&id).await }).await?;
    Ok(axum::Json(row(&node, &record)))
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct CheckpointBody {
    #[serde(default)]
    name: Option<String>,
}

pub(super) async fn checkpoint(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let name = optional_json::<CheckpointBody>(&body)?.name;
    let n = node.clone();
    let ck = detached(async move { n.checkpoint(&id, name).await }).await?;
    let mut body = json!(ck);
    body["memory_snapshot"] = json!(node.capabilities().memory_snapshot);
    Ok((StatusCode::CREATED, axum::Json(body)).into_response())
}

pub(super) async fn sandbox_checkpoints(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    Ok(axum::Json(json!({ "checkpoints": node.checkpoints(Some(&id)).await? })))
}

pub(super) async fn all_checkpoints(
    State(node): Shared,
    headers: HeaderMap,
) -> Result<axum::Json<Value>, NodeError> {
    root(&node, &headers)?;
    Ok(axum::Json(json!({ "checkpoints": node.checkpoints(None).await? })))
}

pub(super) async fn get_checkpoint(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<axum::Json<Value>, NodeError> {
    Ok(axum::Json(json!(node.authorized_checkpoint(&id, bearer(&headers)).await?)))
}

pub(super) async fn delete_checkpoint(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<StatusCode, NodeError> {
    node.authorized_checkpoint(&id, bearer(&headers)).await?;
    node.delete_checkpoint(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct BranchBody {
    #[serde(default)]
    ttl_seconds: Option<u64>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    #[serde(default)]
    on_expire: crate::claims::OnExpire,
}

pub(super) async fn branch(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, NodeError> {
    let ck = node.authorized_checkpoint(&id, bearer(&headers)).await?;
    let b = optional_json::<BranchBody>(&body)?;
    let spec = ClaimRequest {
        template: Some(ck.template),
        ttl_seconds: b.ttl_seconds,
        metadata: b.metadata,
        on_expire: b.on_expire,
        ..Default::default()
    }
    .validate(node.cfg.default_ttl_seconds, node.cfg.max_ttl_seconds)?;
    let n = node.clone();
    let claimed = detached(async move { n.branch(&id, spec).await }).await?;
    Ok((StatusCode::CREATED, axum::Json(claimed_row(&node, &claimed))).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ForkBody {
    count: usize,
    #[serde(default)]
    ttl_seconds: Option<u64>,
}

pub(super) async fn fork(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<ForkBody>,
) -> Result<Response, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let ttl = match req.ttl_seconds {
        None => None,
        t => Some(checked_ttl(t, node.cfg.default_ttl_seconds, node.cfg.max_ttl_seconds)?),
    };
    let n = node.clone();
    let children = detached(async move { n.fork(&id, req.count, ttl).await }).await?;
    let rows: Vec<Value> = children.iter().map(|c| claimed_row(&node, c)).collect();
    Ok((StatusCode::CREATED, axum::Json(json!({ "sandboxes": rows }))).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PromoteBody {
    template: String,
}

pub(super) fn template_row(name: &str, p: &crate::node::Promoted) -> Value {
    json!({
        "name": name,
        "kind": "promoted",
        "digest": p.golden.digest.as_str(),
        "source": p.source,
        "created_ms": p.created_ms,
    })
}

pub(super) async fn promote(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<PromoteBody>,
) -> Result<Response, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let by_root = node.is_root(bearer(&headers));
    let (n, name) = (node.clone(), req.template.clone());
    let p = detached(async move { n.promote(&id, &name, by_root).await }).await?;
    Ok((StatusCode::CREATED, axum::Json(template_row(&req.template, &p))).into_response())
}

pub(super) async fn templates(
    State(node): Shared,
    headers: HeaderMap,
) -> Result<axum::Json<Value>, NodeError> {
    root(&node, &headers)?;
    let mut rows = vec![json!({ "name": "host", "kind": "builtin" })];
    rows.extend(node.cfg.templates.keys().map(|n| json!({ "name": n, "kind": "configured" })));
    rows.extend(node.promoted().iter().map(|(n, p)| template_row(n, p)));
    Ok(axum::Json(json!({ "templates": rows })))
}

pub(super) async fn delete_template(
    State(node): Shared,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<StatusCode, NodeError> {
    root(&node, &headers)?;
    node.delete_template(&name)?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct MoveBody {
    /// The peer to move to; the least loaded live peer when unset.
    #[serde(default)]
    to: Option<String>,
}

pub(super) async fn move_sandbox(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<axum::Json<Value>, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let to = optional_json::<MoveBody>(&body)?.to;
    let n = node.clone();
    let (record, target) =
        detached(async move { n.move_sandbox(&id, to.as_deref()).await }).await?;
    let mut row = row(&node, &record);
    row["owner"] = json!(target.api.trim_start_matches("http://"));
    row["node"] = json!(target.name);
    Ok(axum::Json(row))
}
