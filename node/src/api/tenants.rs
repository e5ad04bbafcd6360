//! `/v1/tenants`: root creates, changes, rotates and deletes tenants; a tenant reads its own
//! record and usage. The records live in the shared store ([`crate::tenants`]).

use super::*;

fn row(r: &crate::tenants::TenantRecord, usage: silk_api::TenantUsage) -> silk_api::Tenant {
    silk_api::Tenant {
        name: r.name.clone(),
        limits: r.limits,
        created_ms: r.created_ms,
        key_since_ms: r.key_since_ms,
        usage,
    }
}

async fn usage(node: &Node, name: &str) -> Result<silk_api::TenantUsage, NodeError> {
    let (checkpoints, store_bytes) = node.tenant_store_usage(name).await?;
    Ok(silk_api::TenantUsage {
        live_sandboxes: node.tenant_sandboxes(name),
        checkpoints,
        store_bytes,
        sandbox_seconds: node.tenant_month_seconds(name),
    })
}

fn unknown(name: &str) -> NodeError {
    NodeError::new(Code::NotFound, format!("no tenant {name:?}"))
}

pub(super) async fn create(
    State(node): Shared,
    headers: HeaderMap,
    JsonBody(req): JsonBody<silk_api::TenantRequest>,
) -> Result<Response, NodeError> {
    root(&node, &headers)?;
    let (record, api_key) = node.tenants.create(&req.name, req.limits()).await?;
    let noted = audited::Noted { target: Some(record.name.clone()), detail: None };
    let created = silk_api::TenantKey { name: record.name, api_key };
    Ok((StatusCode::CREATED, axum::Extension(noted), axum::Json(created)).into_response())
}

pub(super) async fn list(
    State(node): Shared,
    headers: HeaderMap,
) -> Result<axum::Json<silk_api::TenantList>, NodeError> {
    root(&node, &headers)?;
    let mut tenants = vec![];
    for r in node.tenants.all() {
        tenants.push(row(&r, usage(&node, &r.name).await?));
    }
    Ok(axum::Json(silk_api::TenantList { tenants }))
}

/// Root, or the tenant itself; anyone else gets the same 404 as an unknown name.
pub(super) async fn get(
    State(node): Shared,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<axum::Json<silk_api::Tenant>, NodeError> {
    let scope = node.principal(bearer(&headers)).scope()?;
    if scope.as_ref().is_some_and(|t| *t != name) {
        return Err(unknown(&name));
    }
    let r = node.tenants.get(&name).ok_or_else(|| unknown(&name))?;
    Ok(axum::Json(row(&r, usage(&node, &name).await?)))
}

pub(super) async fn patch(
    State(node): Shared,
    headers: HeaderMap,
    Path(name): Path<String>,
    JsonBody(req): JsonBody<silk_api::TenantPatch>,
) -> Result<axum::Json<silk_api::Tenant>, NodeError> {
    root(&node, &headers)?;
    let r = node.tenants.set_limits(&name, &req).await?;
    Ok(axum::Json(row(&r, usage(&node, &name).await?)))
}

pub(super) async fn rotate(
    State(node): Shared,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<axum::Json<silk_api::TenantKey>, NodeError> {
    root(&node, &headers)?;
    let api_key = node.tenants.rotate(&name).await?;
    Ok(axum::Json(silk_api::TenantKey { name, api_key }))
}

/// Refused (`409`) while the tenant has live sandboxes anywhere in the fleet, unless
/// `?force=true`: then its checkpoints are deleted here, and every node releases its sandboxes
/// (and their archives) and deletes its promoted templates as it learns the tenant is gone.
pub(super) async fn delete(
    State(node): Shared,
    headers: HeaderMap,
    Path(name): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<StatusCode, NodeError> {
    root(&node, &headers)?;
    let force = flag(query.as_deref(), "force")?;
    node.tenants.get(&name).ok_or_else(|| unknown(&name))?;
    let live = node.tenant_sandboxes(&name);
    if live > 0 && !force {
        return Err(NodeError::new(
            Code::Conflict,
            format!(
                "tenant {name} has {live} live sandboxes: release them, or delete with ?force=true"
            ),
        ));
    }
    node.tenants.remove(&name).await?;
    let n = node.clone();
    detached(async move { n.forget_tenant(&name).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}
