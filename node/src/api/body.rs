//! Request bodies: JSON objects read exactly as the OpenAPI document describes them. Errors are
//! API errors in the usual shape (400 `bad_request`, 413, 415).
//!
//! Two things serde alone gets wrong for a JSON API: a struct also reads from an array (`[null,
//! null]` would be a valid `TenantPatch`), and an integer field refuses `15.0`, which JSON
//! Schema (and so every generated client) counts as the integer 15.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::header;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{Code, NodeError};

/// A JSON body (`Content-Type: application/json`) holding one object.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = NodeError;

    async fn from_request(req: Request, state: &S) -> Result<Self, NodeError> {
        if !is_json(req.headers()) {
            return Err(NodeError::new(
                Code::UnsupportedMediaType,
                "expected a request with `Content-Type: application/json`",
            ));
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            let code = match rejection.status().as_u16() {
                413 => Code::PayloadTooLarge,
                _ => Code::BadRequest,
            };
            NodeError::new(code, rejection.body_text())
        })?;
        parse(&bytes).map(JsonBody)
    }
}

/// A JSON body that may be left out entirely (every field's default); one that is sent is
/// checked like [`JsonBody`] (content type, size, fields).
#[derive(Debug)]
pub struct OptionalJsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Default> FromRequest<S> for OptionalJsonBody<T> {
    type Rejection = NodeError;

    async fn from_request(req: Request, state: &S) -> Result<Self, NodeError> {
        let headers = req.headers();
        let length = headers.get(header::CONTENT_LENGTH);
        let no_body = match length {
            Some(n) => n.as_bytes() == b"0",
            None => !headers.contains_key(header::TRANSFER_ENCODING),
        };
        if no_body {
            return Ok(OptionalJsonBody(T::default()));
        }
        Ok(OptionalJsonBody(JsonBody::<T>::from_request(req, state).await?.0))
    }
}

/// A JSON body that may be left out (no body, or only whitespace, means every field's default).
pub fn optional<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, NodeError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    parse(body)
}

/// `application/json`, or a `+json` type, with any parameters.
fn is_json(headers: &axum::http::HeaderMap) -> bool {
    let Some(mime) = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let mime = mime.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

/// One JSON object as `T`. The common body parses once; only a body serde refuses is read
/// again as a value with its integral floats made integers, so a refused body costs a second
/// parse and an accepted one nothing.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, NodeError> {
    let bad = |e: serde_json::Error| NodeError::bad_request(format!("request body: {e}"));
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        // Checked before serde so that an array never reads as a struct's fields in order.
        return Err(match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            Err(e) => bad(e),
            Ok(_) => NodeError::bad_request("request body: expected a JSON object"),
        });
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let first = match serde_path_to_error::deserialize(&mut de) {
        Ok(v) => return de.end().map(|()| v).map_err(bad),
        // The message names the field (`count: invalid type ...`), as axum's did.
        Err(e) => NodeError::bad_request(format!("request body: {e}")),
    };
    let Ok(mut value) = serde_json::from_slice::<Value>(body) else { return Err(first) };
    if !integral_floats_to_integers(&mut value) {
        return Err(first);
    }
    serde_json::from_value(value).map_err(|_| first)
}

/// Rewrites every float with no fractional part that fits an integer (`15.0`, `-3e2`) as that
/// integer; says whether it changed anything.
fn integral_floats_to_integers(v: &mut Value) -> bool {
    match v {
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(f64::NAN);
            if f.fract() != 0.0 || !f.is_finite() {
                return false;
            }
            // 2^64 and -2^63 are exact floats; the casts below are exact inside these bounds.
            let whole = if (0.0..18_446_744_073_709_551_616.0).contains(&f) {
                serde_json::Number::from(f as u64)
            } else if (-9_223_372_036_854_775_808.0..0.0).contains(&f) {
                serde_json::Number::from(f as i64)
            } else {
                return false;
            };
            *n = whole;
            true
        }
        Value::Array(items) => {
            items.iter_mut().fold(false, |c, i| integral_floats_to_integers(i) | c)
        }
        Value::Object(map) => {
            map.values_mut().fold(false, |c, i| integral_floats_to_integers(i) | c)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, Default, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Limits {
        #[serde(default)]
        count: Option<u16>,
        #[serde(default)]
        delta: Option<i64>,
        #[serde(default)]
        ratio: Option<f64>,
    }

    fn read(body: &str) -> Result<Limits, String> {
        parse::<Limits>(body.as_bytes()).map_err(|e| e.message)
    }

    #[test]
    fn an_integer_written_as_a_whole_float_is_that_integer() {
        assert_eq!(read(r#"{"count": 15.0}"#).unwrap().count, Some(15));
        assert_eq!(read(r#"{"delta": -3e2}"#).unwrap().delta, Some(-300));
        // A float field keeps reading floats.
        assert_eq!(read(r#"{"ratio": 2.0, "count": 1}"#).unwrap().ratio, Some(2.0));
    }

    #[test]
    fn a_fraction_or_an_integer_out_of_range_is_refused_with_serdes_reason() {
        let e = read(r#"{"count": 15.5}"#).unwrap_err();
        assert!(e.contains("count") && e.contains("15.5"), "{e}");
        let e = read(r#"{"count": 70000.0}"#).unwrap_err();
        assert!(e.contains("count"), "{e}");
        assert!(read(r#"{"count": 1e300}"#).is_err());
    }

    #[test]
    fn only_an_object_is_a_body() {
        for body in ["[null, null]", "[1]", "null", "3", "\"count\"", ""] {
            let e = read(body).unwrap_err();
            assert!(e.starts_with("request body"), "{body}: {e}");
        }
        assert_eq!(read(" {} ").unwrap(), Limits::default());
        assert!(read("{} trailing").is_err());
        assert!(read(r#"{"unknown": 1}"#).unwrap_err().contains("unknown"));
    }
}
