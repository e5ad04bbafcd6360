//! The lifecycle routes: hibernate, wake, archive, checkpoints and branches, fork, promote,
//! move.

use super::*;

pub(super) async fn hibernate(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<axum::Json<silk_api::Sandbox>, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let memory = optional_json::<silk_api::StopRequest>(&body)?.memory;
    let n = node.clone();
    let record = detached(async move { n.hibernate(&id, memory).await }).await?;
    Ok(axum::Json(row(&node, &record)))
}

pub(super) async fn wake(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<axum::Json<silk_api::Sandbox>, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let n = node.clone();
    let live = detached(async move { n.wake(&id).await }).await?;
    Ok(axum::Json(row(&node, &live.record)))
}

pub(super) async fn archive(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<axum::Json<silk_api::Sandbox>, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let memory = optional_json::<silk_api::StopRequest>(&body)?.memory;
    let n = node.clone();
    let record = detached(async move { n.archive(&id, memory).await }).await?;
    Ok(axum::Json(row(&node, &record)))
}

fn checkpoint_list(list: Vec<crate::node::CheckpointInfo>) -> silk_api::CheckpointList {
    silk_api::CheckpointList { checkpoints: list.into_iter().map(|c| c.checkpoint).collect() }
}

pub(super) async fn checkpoint(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let req = optional_json::<silk_api::CheckpointRequest>(&body)?;
    let n = node.clone();
    let ck = detached(async move { n.checkpoint(&id, req.name, req.memory).await }).await?;
    Ok((StatusCode::CREATED, axum::Json(ck.checkpoint)).into_response())
}

pub(super) async fn sandbox_checkpoints(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<axum::Json<silk_api::CheckpointList>, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    Ok(axum::Json(checkpoint_list(node.checkpoints(Some(&id), None).await?)))
}

pub(super) async fn all_checkpoints(
    State(node): Shared,
    headers: HeaderMap,
) -> Result<axum::Json<silk_api::CheckpointList>, NodeError> {
    let scope = node.principal(bearer(&headers)).scope()?;
    Ok(axum::Json(checkpoint_list(node.checkpoints(None, scope.as_deref()).await?)))
}

pub(super) async fn get_checkpoint(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<axum::Json<silk_api::Checkpoint>, NodeError> {
    Ok(axum::Json(node.authorized_checkpoint(&id, bearer(&headers)).await?.checkpoint))
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

pub(super) async fn branch(
    State(api): State<Api>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, NodeError> {
    let node = api.node.clone();
    let (ck, manifest) = node.authorized_checkpoint_read(&id, bearer(&headers)).await?;
    // Where the copy is, a branch starts from it rather than from the store. A peer that cannot
    // be reached leaves it to this node.
    let mut manifest = Some(manifest);
    if let Some(peer) = edge::copy_peer(&api, ck.copy_on.as_deref(), &id, query.as_deref()) {
        match edge::place_branch(&api, peer, &headers, &id, body.clone()).await {
            Ok(res) => return Ok(res),
            Err(e) => tracing::debug!(checkpoint = id, "branch left here: {e}"),
        }
        // That took a trip to a peer: the branch reads the manifest afresh.
        manifest = None;
    }
    let tenant = ck.tenant.clone();
    let b = optional_json::<silk_api::BranchRequest>(&body)?;
    let memory = b.memory;
    let request = ClaimRequest {
        template: Some(ck.checkpoint.template),
        ttl_seconds: b.ttl_seconds,
        metadata: b.metadata,
        on_expire: b.on_expire,
        ..Default::default()
    };
    let mut spec =
        ClaimSpec::validate(request, node.cfg.default_ttl_seconds, node.cfg.max_ttl_seconds)?;
    // A branch belongs to the checkpoint's tenant, and counts against its quota; it runs
    // under the egress policy its source did.
    spec.tenant = tenant;
    spec.egress = ck.egress.clone();
    let n = node.clone();
    let claimed = detached(async move {
        match manifest {
            Some(manifest) => n.branch_from(&id, manifest, spec, memory).await,
            None => n.branch(&id, spec, memory).await,
        }
    })
    .await?;
    let noted = audited::Noted { target: Some(claimed.record.id.clone()), detail: None };
    let row = axum::Json(claimed_row(&node, &claimed));
    Ok((StatusCode::CREATED, axum::Extension(noted), row).into_response())
}

pub(super) async fn fork(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<silk_api::ForkRequest>,
) -> Result<Response, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let ttl = match req.ttl_seconds {
        None => None,
        t => Some(checked_ttl(t, node.cfg.default_ttl_seconds, node.cfg.max_ttl_seconds)?),
    };
    let n = node.clone();
    let children = detached(async move { n.fork(&id, req.count, ttl, req.memory).await }).await?;
    let ids: Vec<&str> = children.iter().map(|c| c.record.id.as_str()).collect();
    let noted = audited::Noted { target: None, detail: Some(format!("made {}", ids.join(" "))) };
    let sandboxes = children.iter().map(|c| claimed_row(&node, c)).collect();
    let list =
        axum::Json(silk_api::SandboxList { sandboxes, next_cursor: None, unreachable: vec![] });
    Ok((StatusCode::CREATED, axum::Extension(noted), list).into_response())
}

pub(super) async fn promote(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<silk_api::PromoteRequest>,
) -> Result<Response, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let by_root = node.is_root(bearer(&headers));
    let (n, name) = (node.clone(), req.template.clone());
    let (full, p) = detached(async move { n.promote(&id, &name, by_root).await }).await?;
    Ok((StatusCode::CREATED, axum::Json(templates::promoted_row(&full, &p))).into_response())
}

pub(super) async fn move_sandbox(
    State(node): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<axum::Json<silk_api::Sandbox>, NodeError> {
    node.authorized(&id, bearer(&headers))?;
    let req = optional_json::<silk_api::MoveRequest>(&body)?;
    let n = node.clone();
    let (record, target) =
        detached(async move { n.move_sandbox(&id, req.to.as_deref(), req.memory).await }).await?;
    Ok(axum::Json(silk_api::Sandbox {
        owner: target.api.split_once("://").map_or(&*target.api, |(_, a)| a).to_string(),
        node: Some(target.name),
        ..row(&node, &record)
    }))
}
