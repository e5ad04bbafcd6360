//! The OpenAPI 3.1 document served at `GET /v1/openapi.json`. Written by hand next to the routes
//! it describes, with this node's limits (lease cap, body size) filled in; tests check that every
//! path and method here is routed and every route is here.

use serde_json::{Value, json};

fn error_responses(codes: &[u16]) -> Value {
    let mut out = serde_json::Map::new();
    for code in codes {
        out.insert(code.to_string(), json!({ "description": "error", "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Error" } } } }));
    }
    Value::Object(out)
}

fn op(summary: &str, ok: (u16, Value), errors: &[u16], body: Option<&str>) -> Value {
    let mut responses = error_responses(errors);
    responses[ok.0.to_string()] = ok.1;
    let mut o = json!({ "summary": summary, "responses": responses });
    if let Some(schema) = body {
        o["requestBody"] = json!({ "required": true, "content": { "application/json": { "schema": { "$ref": format!("#/components/schemas/{schema}") } } } });
    }
    o
}

fn ok_json(schema: &str) -> Value {
    json!({ "description": "ok", "content": { "application/json": { "schema": { "$ref": format!("#/components/schemas/{schema}") } } } })
}

fn ok_any() -> Value {
    json!({ "description": "ok", "content": { "application/json": { "schema": { "type": "object" } } } })
}

/// The limits a node's document states.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_ttl_seconds: u64,
    pub max_body_bytes: usize,
}

pub fn document(limits: Limits) -> Value {
    let max_ttl = limits.max_ttl_seconds;
    let id =
        json!([{ "name": "id", "in": "path", "required": true, "schema": { "type": "string" } }]);
    let mut sandbox = json!({
        "get": op("One claim (sandbox token or root token)", (200, ok_json("Sandbox")), &[401, 404], None),
        "delete": op("Release: destroy the sandbox", (204, json!({ "description": "released" })), &[401, 404], None),
    });
    sandbox["parameters"] = id.clone();
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
            "schemas": {
                "Error": { "type": "object", "required": ["error"], "properties": { "error": { "type": "object", "required": ["code", "message"], "properties": { "code": { "type": "string" }, "message": { "type": "string" } } } } },
                "ClaimRequest": { "type": "object", "additionalProperties": false, "properties": {
                    "template": { "type": "string", "default": "host" },
                    "size": { "enum": ["small", "medium", "large"], "default": "small" },
                    "lane": { "enum": ["none", "egress"], "default": "none" },
                    "ttl_seconds": { "type": "integer", "minimum": 0, "maximum": max_ttl, "description": "0 or absent: the node's default lease" },
                    "metadata": { "type": "object", "maxProperties": 16, "additionalProperties": { "type": "string", "maxLength": 512 } },
                    "on_expire": { "enum": ["destroy", "archive"], "default": "destroy" } } },
                "Sandbox": { "type": "object", "properties": {
                    "id": { "type": "string" }, "token": { "type": "string", "description": "only in the claim response" },
                    "claim_micros": { "type": "integer", "description": "only in the claim response: how long the node took to serve the claim" },
                    "tier": { "enum": ["warm", "clone", "cold"] }, "state": { "enum": ["claimed", "hibernated", "archived"] }, "owner": { "type": "string" },
                    "template": { "type": "string" }, "size": { "enum": ["small", "medium", "large"] }, "lane": { "enum": ["none", "egress"] },
                    "created_ms": { "type": "integer" }, "deadline_ms": { "type": "integer" },
                    "on_expire": { "enum": ["destroy", "archive"] },
                    "metadata": { "type": "object" }, "agent_path": { "type": "string" },
                    "lease_seconds": { "type": "integer" }, "state_since_ms": { "type": "integer" },
                    "from_checkpoint": { "type": ["string", "null"] }, "forked_from": { "type": ["string", "null"] },
                    "memory_snapshot": { "type": "boolean", "description": "false: processes restart on wake, branch and fork (files are exact)" } } },
                "Checkpoint": { "type": "object", "properties": {
                    "id": { "type": "string", "description": "ck_ + 32 hex digits" }, "name": { "type": ["string", "null"] },
                    "sandbox": { "type": "string" }, "template": { "type": "string" }, "created_ms": { "type": "integer" },
                    "bytes": { "type": "integer" }, "uploaded_bytes": { "type": "integer", "description": "only in the create response" } } },
                "CheckpointRequest": { "type": "object", "additionalProperties": false, "properties": { "name": { "type": "string", "maxLength": 128 } } },
                "BranchRequest": { "type": "object", "additionalProperties": false, "properties": {
                    "ttl_seconds": { "type": "integer" }, "metadata": { "type": "object" }, "on_expire": { "enum": ["destroy", "archive"] } } },
                "ForkRequest": { "type": "object", "additionalProperties": false, "required": ["count"], "properties": {
                    "count": { "type": "integer", "minimum": 1, "maximum": 16 }, "ttl_seconds": { "type": "integer" } } },
                "PromoteRequest": { "type": "object", "additionalProperties": false, "required": ["template"], "properties": {
                    "template": { "type": "string", "pattern": "^[a-z0-9_-]{1,64}$" } } },
                "Template": { "type": "object", "properties": {
                    "name": { "type": "string" }, "kind": { "enum": ["builtin", "configured", "promoted"] },
                    "digest": { "type": "string" }, "source": { "type": "string" }, "created_ms": { "type": "integer" } } },
                "Renew": { "type": "object", "additionalProperties": false, "properties": { "ttl_seconds": { "type": "integer" } } },
                "Exec": { "type": "object", "additionalProperties": false, "required": ["argv"], "properties": {
                    "argv": { "type": "array", "items": { "type": "string" }, "minItems": 1 }, "cwd": { "type": "string" },
                    "env": { "type": "object", "additionalProperties": { "type": "string" } }, "user": { "type": "string" },
                    "stdin": { "type": "string" }, "timeout_seconds": { "type": "integer" } } },
                "ExecResult": { "type": "object", "properties": {
                    "exit_code": { "type": "integer" }, "signal": { "type": ["integer", "null"] }, "timed_out": { "type": "boolean" },
                    "stdout": { "type": "string" }, "stderr": { "type": "string" },
                    "stdout_truncated": { "type": "boolean" }, "stderr_truncated": { "type": "boolean" } } },
                "Pools": { "type": "object", "required": ["pools"], "properties": { "pools": { "type": "array", "items": { "type": "object", "required": ["template", "warm"], "properties": {
                    "template": { "type": "string" }, "size": { "type": "string" }, "lane": { "type": "string" }, "warm": { "type": "integer" }, "warm_max": { "type": "integer" } } } } } }
            }
        },
        "security": [{ "bearer": [] }],
        "paths": {
            "/healthz": { "get": op("Liveness", (200, json!({ "description": "ok" })), &[], None) },
            "/metrics": { "get": op("Prometheus metrics", (200, json!({ "description": "text exposition" })), &[], None) },
            "/v1/openapi.json": { "get": op("This document", (200, ok_any()), &[], None) },
            "/v1/info": { "get": op("Node, pools, engine capabilities", (200, ok_any()), &[401], None) },
            "/v1/peers": { "get": op("The mesh as this node sees it: itself and every live peer with its gossiped state", (200, ok_any()), &[401], None) },
            "/v1/pools": {
                "get": op("Warm pool configuration", (200, ok_json("Pools")), &[401], None),
                "put": op("Replace the pools (persisted)", (200, ok_json("Pools")), &[400, 401, 413], Some("Pools")),
            },
            "/v1/drain": {
                "post": op("Stop taking claims; live ones keep running", (200, ok_any()), &[401], None),
                "delete": op("Take claims again", (200, ok_any()), &[401], None),
            },
            "/v1/sandboxes": {
                "post": op("Claim a sandbox: warm hit, clone from golden, or cold boot", (201, ok_json("Sandbox")), &[400, 401, 404, 413, 415, 422, 429, 500, 501, 503, 507], Some("ClaimRequest")),
                "get": op("List claims; filter with metadata=key=value (repeatable)", (200, ok_any()), &[400, 401], None),
            },
            "/v1/sandboxes/{id}": sandbox,
            "/v1/sandboxes/{id}/renew": { "parameters": id.clone(), "post": op("Reset the lease", (200, ok_any()), &[400, 401, 404], Some("Renew")) },
            "/v1/sandboxes/{id}/exec": { "parameters": id.clone(), "post": op("Run a command, buffered", (200, ok_json("ExecResult")), &[400, 401, 404, 413, 503], Some("Exec")) },
            "/v1/sandboxes/{id}/hibernate": { "parameters": id.clone(), "post": op("Snapshot and stop (idempotent); the lease keeps running; any access wakes it", (200, ok_json("Sandbox")), &[401, 404, 409, 500], None) },
            "/v1/sandboxes/{id}/wake": { "parameters": id.clone(), "post": op("Start a hibernated or archived sandbox (an archive gets a fresh lease)", (200, ok_json("Sandbox")), &[401, 404, 409, 503], None) },
            "/v1/sandboxes/{id}/archive": { "parameters": id.clone(), "post": op("Move the sandbox's files to the store and free the host; on a store failure it runs again", (200, ok_json("Sandbox")), &[401, 404, 409, 503], None) },
            "/v1/sandboxes/{id}/checkpoint": { "parameters": id.clone(), "post": op("Capture the files into the store; the sandbox keeps running", (201, ok_json("Checkpoint")), &[400, 401, 404, 409, 503, 507], Some("CheckpointRequest")) },
            "/v1/sandboxes/{id}/checkpoints": { "parameters": id.clone(), "get": op("This sandbox's checkpoints", (200, ok_any()), &[401, 404, 503], None) },
            "/v1/sandboxes/{id}/fork": { "parameters": id.clone(), "post": op("count new sandboxes from the current files, all or none", (201, ok_any()), &[400, 401, 404, 409, 429, 507], Some("ForkRequest")) },
            "/v1/sandboxes/{id}/promote": { "parameters": id.clone(), "post": op("Publish the files as a template (re-promote replaces)", (201, ok_json("Template")), &[400, 401, 404, 409], Some("PromoteRequest")) },
            "/v1/sandboxes/{id}/move": { "parameters": id.clone(), "post": op("Move to another node of the mesh (same id and token)", (200, ok_json("Sandbox")), &[401, 404, 409, 502, 503], None) },
            "/v1/checkpoints": { "get": op("Every checkpoint in the store (root token)", (200, ok_any()), &[401, 503], None) },
            "/v1/checkpoints/{id}": {
                "parameters": id.clone(),
                "get": op("One checkpoint (root or its sandbox's token)", (200, ok_json("Checkpoint")), &[404, 503], None),
                "delete": op("Delete a checkpoint", (204, json!({ "description": "deleted" })), &[404, 503], None),
            },
            "/v1/checkpoints/{id}/claim": { "parameters": id.clone(), "post": op("Branch: a new sandbox from the checkpoint", (201, ok_json("Sandbox")), &[400, 404, 429, 503, 507], Some("BranchRequest")) },
            "/v1/templates": { "get": op("Templates: built in, configured, promoted", (200, ok_any()), &[401], None) },
            "/v1/templates/{name}": {
                "parameters": [{ "name": "name", "in": "path", "required": true, "schema": { "type": "string" } }],
                "delete": op("Delete a promoted template", (204, json!({ "description": "deleted" })), &[401, 404, 409], None),
            },
            "/v1/sandboxes/{id}/agent": { "parameters": id, "get": op("Upgrade: silkd — after 101, a byte relay to the sandbox's silkd", (101, json!({ "description": "switching protocols" })), &[401, 404, 426, 503], None) },
        }
    })
}
