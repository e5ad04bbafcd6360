//! The OpenAPI 3.1 document served at `GET /v1/openapi.json`. The body schemas are generated from
//! the types the handlers answer with (`silk_api`, via utoipa), so a shape cannot drift from the
//! document; the paths table is here, beside the routes it describes, and tests check that every
//! path and method here is routed and every route is here. This node's limits (lease cap, body
//! size) are filled in.

use serde_json::{Value, json};

fn error_responses(codes: &[u16]) -> Value {
    let mut out = serde_json::Map::new();
    for code in codes {
        out.insert(code.to_string(), json!({ "description": "error", "content": { "application/json": { "schema": { "$ref": "#/components/schemas/ErrorBody" } } } }));
    }
    Value::Object(out)
}

/// A request body: `Some("Name")` required, `Some("Name?")` one that may be left out.
fn op(summary: &str, ok: (u16, Value), errors: &[u16], body: Option<&str>) -> Value {
    let mut responses = error_responses(errors);
    responses[ok.0.to_string()] = ok.1;
    let mut o = json!({ "summary": summary, "responses": responses });
    if let Some(schema) = body {
        let (schema, required) = match schema.strip_suffix('?') {
            Some(optional) => (optional, false),
            None => (schema, true),
        };
        o["requestBody"] = json!({ "required": required, "content": { "application/json": { "schema": { "$ref": format!("#/components/schemas/{schema}") } } } });
    }
    o
}

/// The claim: `201`, or with `Upgrade: silkd` a `101` carrying the row in `silk-sandbox`.
fn claim_op() -> Value {
    let mut o = op(
        "Claim a sandbox: warm hit, clone from golden, or cold boot. With `Connection: upgrade` and `Upgrade: silkd`, a claim is answered 101 and the connection becomes the new sandbox's relay",
        (201, ok_json("Sandbox")),
        &[400, 401, 403, 404, 413, 415, 422, 429, 500, 501, 503, 507],
        Some("ClaimRequest?"),
    );
    o["responses"]["101"] = json!({
        "description": "claimed (asked with `Upgrade: silkd`); the connection is now the sandbox's relay",
        "headers": {
            "silk-sandbox": { "description": "the new sandbox's row, with its token, as JSON", "schema": { "type": "string" } },
            "silk-agent-info": { "description": "asked with `silk-ask: info`: silkd's `info` answer on this connection, as JSON", "schema": { "type": "string" } },
        },
    });
    let ask = json!({ "name": "silk-ask", "in": "header", "required": false, "schema": { "type": "string", "enum": ["info"] }, "description": "with the upgrade: answer 101 only once the sandbox's silkd answered `info` on the relay (its answer in `silk-agent-info`)" });
    match o["parameters"].as_array_mut() {
        Some(params) => params.push(ask),
        None => o["parameters"] = json!([ask]),
    }
    o
}

/// `op` with optional query parameters.
fn queries(op: Value, params: &[(&str, Value)]) -> Value {
    params.iter().fold(op, |op, (name, schema)| with_query(op, name, schema.clone()))
}

/// `op` with an optional query parameter.
fn with_query(mut op: Value, name: &str, schema: Value) -> Value {
    let param = json!({ "name": name, "in": "query", "required": false, "schema": schema });
    match op["parameters"].as_array_mut() {
        Some(params) => params.push(param),
        None => op["parameters"] = json!([param]),
    }
    op
}

/// `op` with a second success answer.
fn also(mut op: Value, status: u16, answer: Value) -> Value {
    op["responses"][status.to_string()] = answer;
    op
}

fn ok_json(schema: &str) -> Value {
    json!({ "description": "ok", "content": { "application/json": { "schema": { "$ref": format!("#/components/schemas/{schema}") } } } })
}

/// What a node's document states of its configuration.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_ttl_seconds: u64,
    pub max_body_bytes: usize,
    /// A root token is configured (without one, no call needs a bearer token).
    pub api_token: bool,
    /// A `metrics_token` is configured (without one, `/metrics` is open).
    pub metrics_token: bool,
    pub max_warm: usize,
}

pub fn document(limits: Limits) -> Value {
    let mut doc = paths_and_schemas(limits);
    add_common_answers(&mut doc);
    add_links(&mut doc);
    let open: &[&str] = match (limits.api_token, limits.metrics_token) {
        (false, _) => &[],
        (true, true) => &["/healthz", "/v1/openapi.json"],
        (true, false) => &["/healthz", "/v1/openapi.json", "/metrics"],
    };
    if limits.api_token {
        for path in open {
            doc["paths"][*path]["get"]["security"] = json!([]);
        }
    } else {
        doc.as_object_mut().map(|d| d.remove("security"));
    }
    doc
}

/// Every operation gets an `operationId` (`post_sandboxes_id_exec`), and the operations that
/// make something link to those that use it, so that a client generator or a fuzzer can follow
/// a claim's id into exec, a checkpoint's into branch, a tenant's name into its routes.
fn add_links(doc: &mut Value) {
    let Some(paths) = doc["paths"].as_object_mut() else { return };
    let mut ops = vec![];
    for (path, item) in paths.iter_mut() {
        let Some(item) = item.as_object_mut() else { continue };
        for (method, op) in item.iter_mut().filter(|(m, _)| *m != "parameters") {
            let id = format!("{method}{path}")
                .replace("/v1/", "/")
                .replace(['/', '{', '}', '.'], "_")
                .replace("__", "_")
                .trim_end_matches('_')
                .to_string();
            op["operationId"] = json!(id);
            ops.push((path.clone(), id));
        }
    }
    // (path, method, status, where the new thing's name is) -> (paths that take it, parameter).
    let producers: [(&str, &str, &str, &str, &str, &str); 7] = [
        ("/v1/sandboxes", "post", "201", "$response.body#/id", "/v1/sandboxes/{id}", "id"),
        (
            "/v1/checkpoints/{id}/claim",
            "post",
            "201",
            "$response.body#/id",
            "/v1/sandboxes/{id}",
            "id",
        ),
        (
            "/v1/sandboxes/{id}/fork",
            "post",
            "201",
            "$response.body#/sandboxes/0/id",
            "/v1/sandboxes/{id}",
            "id",
        ),
        (
            "/v1/sandboxes/{id}/checkpoint",
            "post",
            "201",
            "$response.body#/id",
            "/v1/checkpoints/{id}",
            "id",
        ),
        (
            "/v1/sandboxes/{id}/promote",
            "post",
            "201",
            "$response.body#/name",
            "/v1/templates/{name}",
            "name",
        ),
        ("/v1/tenants", "post", "201", "$response.body#/name", "/v1/tenants/{name}", "name"),
        (
            "/v1/sandboxes/{id}/previews",
            "post",
            "201",
            "$response.body#/token",
            "/v1/sandboxes/{id}/previews/{token}",
            "token",
        ),
    ];
    for (path, method, status, value, prefix, param) in producers {
        let mut links = serde_json::Map::new();
        for (target, id) in ops.iter().filter(|(p, _)| p.starts_with(prefix)) {
            let mut parameters = json!({ param: value });
            if target.starts_with("/v1/sandboxes/{id}") && param != "id" {
                parameters["id"] = json!("$request.path.id");
            }
            links.insert(id.clone(), json!({ "operationId": id, "parameters": parameters }));
        }
        paths[path][method]["responses"][status]["links"] = Value::Object(links);
    }
}

/// Answers many operations share: a failure inside the node (500, every `/v1` operation); a
/// body that does not parse, is too large or is not JSON (every operation with a body); and
/// in a mesh, a call on a sandbox held elsewhere — a
/// redirect to it, or its node unreachable (502) or not answering yet (503).
fn add_common_answers(doc: &mut Value) {
    let Some(paths) = doc["paths"].as_object_mut() else { return };
    for (path, item) in paths.iter_mut() {
        let Some(item) = item.as_object_mut() else { continue };
        for (method, op) in item.iter_mut().filter(|(m, _)| *m != "parameters") {
            let mut statuses = vec![];
            if path.starts_with("/v1/") && path != "/v1/openapi.json" {
                // A call without a credential, or with one no node knows.
                statuses.extend([401, 500]);
            }
            if op.get("requestBody").is_some() {
                statuses.extend([400, 413, 415]);
            }
            let on_sandbox = path.starts_with("/v1/sandboxes/{id}");
            let placed = path == "/v1/sandboxes" || path == "/v1/checkpoints/{id}/claim";
            if on_sandbox || (placed && method == "post") {
                statuses.extend([307, 502, 503]);
            }
            if on_sandbox {
                // Finding the node that holds it is rate-limited per client.
                statuses.push(429);
            }
            for status in statuses {
                let responses = &mut op["responses"];
                if responses.get(status.to_string()).is_none() {
                    responses[status.to_string()] = if status == 307 {
                        json!({ "description": "held by (or placed on) another node: follow `Location` (its `no_redirect=1` keeps it there)" })
                    } else {
                        error_responses(&[status])[status.to_string()].clone()
                    };
                }
            }
        }
    }
}

fn paths_and_schemas(limits: Limits) -> Value {
    let id =
        json!([{ "name": "id", "in": "path", "required": true, "schema": { "type": "string" } }]);
    let mut sandbox = json!({
        "get": op("One claim (sandbox token or root token)", (200, ok_json("Sandbox")), &[401, 404], None),
        "delete": op("Release: destroy the sandbox", (204, json!({ "description": "released" })), &[401, 404], None),
    });
    sandbox["parameters"] = id.clone();
    // The ports route passes any method through; each is described the same way.
    let mut ports = json!({});
    let port = json!({ "name": "port", "in": "path", "required": true, "schema": { "type": "integer", "minimum": 1, "maximum": 65535 } });
    let rest =
        json!({ "name": "path", "in": "path", "required": true, "schema": { "type": "string" } });
    for method in ["get", "head", "post", "put", "patch", "delete", "options"] {
        let passed = json!({ "description": "the answer of the server on that port inside the sandbox, passed through (any status; 101 for an upgrade)" });
        ports[method] = op(
            "HTTP or WebSocket to 127.0.0.1:{port} inside the sandbox, over silkd's port forward (sandbox token, root, its tenant's key, or a preview token in ?token= or the silkmesh_preview cookie; never passed to the sandbox)",
            (200, passed),
            &[400, 401, 404, 502, 503],
            None,
        );
        ports[method]["responses"]["303"] = json!({ "description": "a preview's first visit (?token=): to the same address without the token, with the cookie that carries it" });
    }
    let mut ports_root = ports.clone();
    ports["parameters"] = json!([id[0], port, rest]);
    ports_root["parameters"] = json!([id[0], port]);
    let id = &id;
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "silkmesh sandboxd",
            "version": env!("CARGO_PKG_VERSION"),
            "description": format!("Request bodies up to {} bytes (413 beyond).", limits.max_body_bytes),
        },
        "components": {
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "schemas": schemas(limits),
        },
        "security": [{ "bearer": [] }],
        "paths": {
            "/healthz": { "get": op("Liveness", (200, json!({ "description": "ok" })), &[], None) },
            "/metrics": { "get": op("Prometheus metrics (bearer `metrics_token` or root when `metrics_token` is set)", (200, json!({ "description": "text exposition" })), &[401], None) },
            "/v1/openapi.json": { "get": op("This document", (200, json!({ "description": "ok", "content": { "application/json": { "schema": { "type": "object" } } } })), &[], None) },
            "/v1/info": { "get": op("Node, pools, engine capabilities", (200, ok_json("NodeInfo")), &[401], None) },
            "/v1/peers": { "get": op("The mesh as this node sees it: itself and every live peer with its gossiped state", (200, ok_json("MeshView")), &[401], None) },
            "/v1/pools": {
                "get": op("Warm pool configuration", (200, ok_json("Pools")), &[401], None),
                "put": op("Replace the pools (persisted)", (200, ok_json("Pools")), &[400, 401, 413, 422], Some("Pools")),
            },
            "/v1/drain": {
                "post": op("Stop taking claims; live ones keep running", (200, ok_json("NodeInfo")), &[401], None),
                "delete": op("Take claims again", (200, ok_json("NodeInfo")), &[401], None),
            },
            "/v1/sandboxes": {
                "post": claim_op(),
                "get": queries(op("The caller's sandboxes on every node (this one's with scope=node), oldest first, paged; filter with metadata=key=value (repeatable)", (200, ok_json("SandboxList")), &[400, 401], None), &[("metadata", json!({ "type": "string", "pattern": "^[^=]+=" })), ("limit", json!({ "type": "integer", "minimum": 1, "maximum": 1000 })), ("cursor", json!({ "type": "string" })), ("scope", json!({ "enum": ["node"] }))]),
            },
            "/v1/sandboxes/{id}": sandbox,
            "/v1/sandboxes/{id}/renew": { "parameters": id.clone(), "post": op("Reset the lease", (200, ok_json("Renewed")), &[400, 401, 404, 413, 415], Some("RenewRequest")) },
            "/v1/sandboxes/{id}/exec": { "parameters": id.clone(), "post": op("Run a command, buffered", (200, ok_json("ExecResult")), &[400, 401, 403, 404, 413, 422, 503], Some("ExecRequest")) },
            "/v1/sandboxes/{id}/hibernate": { "parameters": id.clone(), "post": op("Snapshot and stop (idempotent); the lease keeps running; any access wakes it", (200, ok_json("Sandbox")), &[401, 404, 409, 500], Some("StopRequest?")) },
            "/v1/sandboxes/{id}/wake": { "parameters": id.clone(), "post": op("Start a hibernated or archived sandbox (an archive gets a fresh lease)", (200, ok_json("Sandbox")), &[401, 404, 409, 503], None) },
            "/v1/sandboxes/{id}/archive": { "parameters": id.clone(), "post": op("Move the sandbox's files to the store and free the host; on a store failure it runs again", (200, ok_json("Sandbox")), &[401, 404, 409, 503], Some("StopRequest?")) },
            "/v1/sandboxes/{id}/checkpoint": { "parameters": id.clone(), "post": op("Capture the files into the store; the sandbox keeps running", (201, ok_json("Checkpoint")), &[400, 401, 404, 409, 429, 503, 507], Some("CheckpointRequest?")) },
            "/v1/sandboxes/{id}/checkpoints": { "parameters": id.clone(), "get": op("This sandbox's checkpoints", (200, ok_json("CheckpointList")), &[401, 404, 503], None) },
            "/v1/sandboxes/{id}/fork": { "parameters": id.clone(), "post": op("count new sandboxes from the current files, all or none", (201, ok_json("SandboxList")), &[400, 401, 404, 409, 413, 415, 429, 507], Some("ForkRequest")) },
            "/v1/sandboxes/{id}/promote": { "parameters": id.clone(), "post": op("Publish the files as a template (re-promote replaces)", (201, ok_json("Template")), &[400, 401, 404, 409], Some("PromoteRequest")) },
            "/v1/sandboxes/{id}/move": { "parameters": id.clone(), "post": op("Move to another node of the mesh (same id and token)", (200, ok_json("Sandbox")), &[400, 401, 404, 409, 502, 503], Some("MoveRequest?")) },
            "/v1/checkpoints": { "get": op("Every checkpoint in the store (root token), or a tenant's (its key)", (200, ok_json("CheckpointList")), &[401, 503], None) },
            "/v1/checkpoints/{id}": {
                "parameters": id.clone(),
                "get": op("One checkpoint (root or its sandbox's token)", (200, ok_json("Checkpoint")), &[404, 503], None),
                "delete": op("Delete a checkpoint", (204, json!({ "description": "deleted" })), &[404, 503], None),
            },
            "/v1/checkpoints/{id}/claim": { "parameters": id.clone(), "post": op("Branch: a new sandbox from the checkpoint", (201, ok_json("Sandbox")), &[400, 404, 409, 429, 503, 507], Some("BranchRequest?")) },
            "/v1/templates": {
                "get": op("Templates: built in, configured, promoted, registered (a tenant sees root's and its own)", (200, ok_json("TemplateList")), &[401], None),
                "post": also(with_query(op("Register a registry image as a template on the whole fleet (a tenant's under its prefix): pinned to its digest now, pulled here at once (202), or ?wait=true: answered when pulled (201)", (202, ok_json("Template")), &[400, 401, 403, 404, 409, 413, 415, 422, 502, 503, 507], Some("RegisterTemplate")), "wait", json!({ "type": "boolean" })), 201, ok_json("Template")),
            },
            "/v1/audit": { "get": queries(op("The audit journal of every node (this one's with scope=node), oldest first (root: every entry or a tenant's; a tenant: its own)", (200, ok_json("AuditList")), &[400, 401], None), &[("since", json!({ "type": "integer", "minimum": 0, "maximum": u64::MAX })), ("tenant", json!({ "type": "string" })), ("limit", json!({ "type": "integer", "minimum": 1, "maximum": 10000 })), ("scope", json!({ "enum": ["node"] }))]) },
            "/v1/usage": { "get": queries(op("Sandbox-seconds per tenant, size and lane metered in [from, to) (default: this month), summed over every node (this one's with scope=node); root: all or one tenant's, a tenant: its own", (200, ok_json("UsageReport")), &[400, 401], None), &[("from", json!({ "type": "integer", "minimum": 0, "maximum": u64::MAX })), ("to", json!({ "type": "integer", "minimum": 0, "maximum": u64::MAX })), ("tenant", json!({ "type": "string" })), ("scope", json!({ "enum": ["node"] }))]) },
            "/v1/fleet": { "get": queries(op("Every node's report (root)", (200, ok_json("FleetView")), &[400, 401], None), &[("scope", json!({ "enum": ["node"] }))]) },
            "/v1/tenants": {
                "post": op("Create a tenant (root): its key is in the answer, this once", (201, ok_json("TenantKey")), &[400, 401, 409, 413, 415, 503], Some("TenantRequest")),
                "get": op("Every tenant with its limits and usage (root)", (200, ok_json("TenantList")), &[401, 503], None),
            },
            "/v1/tenants/{name}": {
                "parameters": [{ "name": "name", "in": "path", "required": true, "schema": { "type": "string" } }],
                "get": op("One tenant: limits and usage (root, or the tenant's key)", (200, ok_json("Tenant")), &[401, 404, 503], None),
                "patch": op("Change limits (root)", (200, ok_json("Tenant")), &[400, 401, 404, 413, 415, 503], Some("TenantPatch")),
                "delete": with_query(op("Delete (root): refused while it has live sandboxes unless ?force=true, which releases them and deletes its checkpoints, archives and templates", (204, json!({ "description": "deleted" })), &[400, 401, 404, 409, 503], None), "force", json!({ "type": "boolean" })),
            },
            "/v1/tenants/{name}/rotate": {
                "parameters": [{ "name": "name", "in": "path", "required": true, "schema": { "type": "string" } }],
                "post": op("A new key (root); the old one stops working", (200, ok_json("TenantKey")), &[401, 404, 503], None),
            },
            "/v1/templates/{name}": {
                "parameters": [{ "name": "name", "in": "path", "required": true, "schema": { "type": "string" } }],
                "get": op("One template, with its pull on this node when it is a registry image", (200, ok_json("Template")), &[401, 404], None),
                "delete": op("Delete a promoted or registered template", (204, json!({ "description": "deleted" })), &[401, 404, 409, 503], None),
            },
            "/v1/templates/{name}/refresh": {
                "parameters": [{ "name": "name", "in": "path", "required": true, "schema": { "type": "string" } }],
                "post": op("Resolve a registry template's reference again; on a new digest it is pinned to it, its goldens and warm sandboxes go, and it is pulled", (200, ok_json("Template")), &[401, 403, 404, 409, 422, 502, 503], None),
            },
            "/v1/sandboxes/{id}/previews": { "parameters": id.clone(), "post": op("A preview URL of a port: opens it to a browser without the sandbox token until it expires (at most a day)", (201, ok_json("Preview")), &[400, 401, 404, 409, 413, 415, 503], Some("PreviewRequest")) },
            "/v1/sandboxes/{id}/previews/{token}": { "parameters": [id[0], { "name": "token", "in": "path", "required": true, "schema": { "type": "string" } }], "delete": op("Revoke a preview", (204, json!({ "description": "revoked" })), &[401, 404], None) },
            "/v1/sandboxes/{id}/ports/{port}": ports_root,
            "/v1/sandboxes/{id}/ports/{port}/{path}": ports,
            "/v1/sandboxes/{id}/agent": { "parameters": id, "get": op("Upgrade: silkd — after 101, a byte relay to the sandbox's silkd", (101, json!({ "description": "switching protocols" })), &[401, 404, 426, 503], None) },
        }
    })
}

/// The body schemas, generated from the types, with what a type cannot say: this node's lease
/// cap, the metadata bound, and the range of every unsigned integer.
fn schemas(limits: Limits) -> Value {
    let mut schemas = silk_api::schemas();
    for (name, field) in [
        ("ClaimRequest", "ttl_seconds"),
        ("RenewRequest", "ttl_seconds"),
        ("BranchRequest", "ttl_seconds"),
        ("ForkRequest", "ttl_seconds"),
    ] {
        schemas[name]["properties"][field]["maximum"] = json!(limits.max_ttl_seconds);
    }
    for field in ["warm", "warm_max"] {
        schemas["PoolConfig"]["properties"][field]["maximum"] = json!(limits.max_warm);
    }
    for name in ["ClaimRequest", "BranchRequest"] {
        let metadata = &mut schemas[name]["properties"]["metadata"];
        metadata["maxProperties"] = json!(silk_api::MAX_METADATA_PAIRS);
        metadata["propertyNames"]["minLength"] = json!(1);
        metadata["propertyNames"]["maxLength"] = json!(silk_api::MAX_METADATA_KEY);
        metadata["additionalProperties"]["maxLength"] = json!(silk_api::MAX_METADATA_VALUE);
    }
    exact_unsigned(&mut schemas);
    schemas
}

/// An unsigned field reads every integer from 0 to its type's maximum; the generated schema says
/// `format: int64` (whose range stops at 2^63 - 1) or nothing. The stated bound is `u64::MAX`
/// unless the type gave a smaller one (every such field here is a `u64` or a `usize` on a 64-bit
/// node; the narrower ones carry their own `maximum`).
fn exact_unsigned(v: &mut Value) {
    match v {
        Value::Object(o) => {
            let integer = match o.get("type") {
                Some(Value::String(t)) => t == "integer",
                Some(Value::Array(ts)) => ts.iter().any(|t| t == "integer"),
                _ => false,
            };
            if integer && o.get("minimum") == Some(&json!(0)) && !o.contains_key("maximum") {
                o.remove("format");
                o.insert("maximum".into(), json!(u64::MAX));
            }
            o.values_mut().for_each(exact_unsigned);
        }
        Value::Array(items) => items.iter_mut().for_each(exact_unsigned),
        _ => {}
    }
}
