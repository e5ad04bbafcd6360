//! API errors: one status, one machine-readable code, one message — mapped here and nowhere
//! else. The body is `{"error": {"code": "...", "message": "..."}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use silk_engine::EngineError;

#[derive(Debug, Clone, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, code, message: message.into() }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    /// Unknown sandboxes and wrong sandbox tokens look the same: no hint that an id exists.
    pub fn sandbox_not_found() -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such sandbox")
    }

    pub fn unauthorized() -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "a valid bearer token is required")
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> ApiError {
        use EngineError::*;
        let (status, code) = match &e {
            TemplateNotFound(_) => (StatusCode::NOT_FOUND, "template_not_found"),
            BadTemplate(_) => (StatusCode::UNPROCESSABLE_ENTITY, "bad_template"),
            WarmupFailed(_) => (StatusCode::UNPROCESSABLE_ENTITY, "warmup_failed"),
            NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            Exists(_) => (StatusCode::CONFLICT, "conflict"),
            Unsupported { .. } => (StatusCode::NOT_IMPLEMENTED, "unsupported"),
            BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            NotReady(_) => (StatusCode::SERVICE_UNAVAILABLE, "sandbox_not_ready"),
            Host(_) | Io { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "engine_failed"),
        };
        ApiError::new(status, code, e.to_string())
    }
}

impl From<silk_store::StoreError> for ApiError {
    fn from(e: silk_store::StoreError) -> ApiError {
        use silk_store::StoreError::*;
        let (status, code) = match &e {
            NotFound { .. } => (StatusCode::NOT_FOUND, "not_found"),
            Unavailable { .. } => (StatusCode::SERVICE_UNAVAILABLE, "store_unavailable"),
            Corrupt { .. } | CorruptManifest { .. } | UnsupportedFormat { .. } => {
                (StatusCode::INTERNAL_SERVER_ERROR, "store_corrupt")
            }
            Refused { .. } => (StatusCode::BAD_GATEWAY, "store_refused"),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "store_failed"),
        };
        ApiError::new(status, code, e.to_string())
    }
}

impl ApiError {
    /// The JSON body every error answer carries.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({ "error": { "code": self.code, "message": self.message } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
