//! E2B's copies over the node's: `fork` (one image, `count` children that continue its
//! processes where the node keeps memory), snapshots (checkpoints: `POST
//! /sandboxes/{id}/snapshots`, `GET /snapshots`, `DELETE /templates/{snapshotID}`), and a create
//! whose `templateID` is a snapshot id (a branch).

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use silk_api::Memory;

use super::control::{Answer, body, caller, error, node_error, owned, sandbox, template_id};
use super::{E2b, HttpError, header};
use crate::claims::ClaimSpec;
use crate::node::{Claimed, detached};

#[derive(Debug, Deserialize)]
struct ForkRequest {
    timeout: Option<u64>,
    count: Option<usize>,
}

/// `POST /sandboxes/{id}/fork`: `201` with one `{"sandbox": …}` per child (all or none: the
/// node's fork makes every child or none).
pub(super) async fn fork(
    State(e2b): State<E2b>,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: axum::body::Bytes,
) -> Answer {
    let r = owned(&e2b, &headers, &id)?;
    let req: ForkRequest = body(&raw)?;
    let cfg = &e2b.node.cfg;
    let ttl = crate::claims::checked_ttl(req.timeout, r.lease_seconds, cfg.max_ttl_seconds)
        .map_err(node_error)?;
    let (node, source, count) = (e2b.node.clone(), id.clone(), req.count.unwrap_or(1));
    let kids = detached(async move { node.fork(&source, count, Some(ttl), Memory::Auto).await })
        .await
        .map_err(node_error)?;
    let template = template_id(&e2b, &r).to_string();
    let results: Vec<Value> = kids
        .iter()
        .map(|kid| {
            e2b.inherit_envs(&id, &kid.record.id);
            json!({ "sandbox": sandbox(&e2b, &kid.record.id, &template) })
        })
        .collect();
    Ok(super::json(StatusCode::CREATED, Value::Array(results)))
}

#[derive(Debug, Deserialize)]
struct SnapshotRequest {
    name: Option<String>,
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/snapshots`: a checkpoint (the sandbox keeps running).
pub(super) async fn snapshot(
    State(e2b): State<E2b>,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: axum::body::Bytes,
) -> Answer {
    owned(&e2b, &headers, &id)?;
    let req: SnapshotRequest = body(&raw)?;
    let memory = if req.memory == Some(false) { Memory::Off } else { Memory::Auto };
    let node = e2b.node.clone();
    let ck = detached(async move { node.checkpoint(&id, req.name, memory).await })
        .await
        .map_err(node_error)?;
    Ok(super::json(StatusCode::CREATED, info(&ck.checkpoint)))
}

fn info(ck: &silk_api::Checkpoint) -> Value {
    json!({ "snapshotID": ck.id, "names": ck.name.iter().collect::<Vec<_>>() })
}

/// `GET /snapshots` (`sandboxID`, `name` filters): the caller's checkpoints.
pub(super) async fn snapshots(
    State(e2b): State<E2b>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> Answer {
    let tenant = caller(&e2b, &headers)?;
    let pairs = super::control::pairs(&q.unwrap_or_default());
    let param = |key: &str| pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
    let (sandbox, name) = (param("sandboxID"), param("name"));
    let all =
        e2b.node.checkpoints(sandbox.as_deref(), tenant.as_deref()).await.map_err(node_error)?;
    let body: Vec<Value> = all
        .iter()
        .filter(|ck| name.is_none() || ck.name == name)
        .map(|ck| info(&ck.checkpoint))
        .collect();
    Ok(super::json(StatusCode::OK, Value::Array(body)))
}

/// `DELETE /templates/{id}`: a snapshot's (templates themselves are the node's).
pub(super) async fn delete(
    State(e2b): State<E2b>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Answer {
    caller(&e2b, &headers)?;
    if !id.starts_with("ck_") {
        return Err(error(StatusCode::NOT_IMPLEMENTED, "templates are the node's configuration"));
    }
    let key = header(&headers, "x-api-key");
    e2b.node.authorized_checkpoint(&id, key).await.map_err(node_error)?;
    e2b.node.delete_checkpoint(&id).await.map_err(node_error)?;
    Ok(super::json(StatusCode::NO_CONTENT, Value::Null))
}

/// A create whose `templateID` is a snapshot: a branch of it, owned by its tenant.
pub(super) async fn branch(
    e2b: &E2b,
    headers: &HeaderMap,
    snapshot: &str,
    mut spec: ClaimSpec,
) -> Result<Claimed, HttpError> {
    let key = header(headers, "x-api-key");
    let (ck, manifest) = e2b.node.authorized_checkpoint_read(snapshot, key).await.map_err(|e| {
        error(StatusCode::NOT_FOUND, format!("snapshot {snapshot:?} not found: {}", e.message))
    })?;
    spec.template = ck.checkpoint.template.clone();
    spec.tenant = ck.tenant.clone();
    let (node, id) = (e2b.node.clone(), snapshot.to_string());
    let branched = async move { node.branch_from(&id, manifest, spec, Memory::Auto).await };
    detached(branched).await.map_err(node_error)
}
