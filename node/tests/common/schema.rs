//! Checks answers against the node's own OpenAPI document: the route and method are documented,
//! the status is one the operation lists, and the body validates against that status's schema.
//! The validator covers the JSON Schema the document uses (`$ref`, `oneOf`, `type` with `null`,
//! `enum`, `properties`/`required`, `additionalProperties`, `items`, numeric and length bounds)
//! and is stricter in one way: a property the schema does not name is an error, so a field
//! the node answers with but the document lacks is drift, caught here.
#![allow(dead_code)]

use serde_json::Value;

/// Why `body` (answered `status` to `method path`) does not match `doc`, or `None`.
pub fn check_answer(
    doc: &Value,
    method: &str,
    path: &str,
    status: u16,
    body: &Value,
) -> Option<String> {
    let path = path.split('?').next().unwrap_or(path);
    assert!(doc["openapi"].is_string(), "not an OpenAPI document: {doc}");
    let paths = doc["paths"].as_object().expect("an OpenAPI document has paths");
    let found = paths.iter().find(|(t, _)| matches(t, path));
    let op = found.map_or(&Value::Null, |(_, item)| &item[method.to_ascii_lowercase()]);
    let Some((template, _)) = found.filter(|_| !op.is_null()) else {
        // No such route: the fallback's 404 `no_route` or 405, in the error shape.
        let mut errors = vec![];
        validate(
            doc,
            &serde_json::json!({ "$ref": "#/components/schemas/ErrorBody" }),
            body,
            "$",
            &mut errors,
        );
        if !matches!(status, 404 | 405) || !errors.is_empty() {
            return Some(format!("{method} {path} (not documented) answered {status} {body}"));
        }
        return None;
    };
    let response = &op["responses"][status.to_string()];
    if response.is_null() {
        return Some(format!("{method} {template} answered {status}, which it does not document"));
    }
    let schema = &response["content"]["application/json"]["schema"];
    if schema.is_null() || method.eq_ignore_ascii_case("HEAD") {
        return None; // no JSON body documented (204, 101, text), or none sent (HEAD)
    }
    let mut errors = vec![];
    validate(doc, schema, body, "$", &mut errors);
    (!errors.is_empty()).then(|| format!("{method} {template} {status}: {}", errors.join("; ")))
}

fn matches(template: &str, path: &str) -> bool {
    let (t, p): (Vec<&str>, Vec<&str>) = (template.split('/').collect(), path.split('/').collect());
    t.len() == p.len()
        && t.iter().zip(&p).all(|(t, p)| (t.starts_with('{') && !p.is_empty()) || t == p)
}

fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema["$ref"].as_str() {
        Some(r) => {
            let name = r.strip_prefix("#/components/schemas/").unwrap_or(r);
            let target = &doc["components"]["schemas"][name];
            assert!(!target.is_null(), "the document's $ref {r} names no schema");
            resolve(doc, target)
        }
        None => schema,
    }
}

fn type_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

pub fn validate(doc: &Value, schema: &Value, v: &Value, at: &str, errors: &mut Vec<String>) {
    let schema = resolve(doc, schema);
    if let Some(options) = schema["oneOf"].as_array().or(schema["anyOf"].as_array()) {
        let fits = options.iter().any(|o| {
            let mut e = vec![];
            validate(doc, o, v, at, &mut e);
            e.is_empty()
        });
        if !fits {
            errors.push(format!("{at}: {v} fits none of the alternatives"));
        }
        return;
    }
    if let Some(all) = schema["allOf"].as_array() {
        for s in all {
            validate(doc, s, v, at, errors);
        }
    }
    let actual = type_of(v);
    let allowed: Vec<&str> = match &schema["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
        _ => vec![],
    };
    let fits = allowed.is_empty()
        || allowed.contains(&actual)
        || (actual == "integer" && allowed.contains(&"number"));
    if !fits {
        errors.push(format!("{at}: a {actual}, the schema says {allowed:?}"));
        return;
    }
    if let Some(options) = schema["enum"].as_array()
        && !options.contains(v)
    {
        errors.push(format!("{at}: {v} is not one of {options:?}"));
    }
    if let Some(n) = v.as_f64() {
        if schema["minimum"].as_f64().is_some_and(|m| n < m) {
            errors.push(format!("{at}: {n} is below the minimum"));
        }
        if schema["maximum"].as_f64().is_some_and(|m| n > m) {
            errors.push(format!("{at}: {n} is above the maximum"));
        }
    }
    if let Some(s) = v.as_str() {
        let len = s.chars().count() as u64;
        if schema["maxLength"].as_u64().is_some_and(|m| len > m)
            || schema["minLength"].as_u64().is_some_and(|m| len < m)
        {
            errors.push(format!("{at}: a string of {len} characters is out of bounds"));
        }
    }
    if let Some(items) = v.as_array() {
        for (i, item) in items.iter().enumerate() {
            if !schema["items"].is_null() {
                validate(doc, &schema["items"], item, &format!("{at}[{i}]"), errors);
            }
        }
    }
    if let Some(object) = v.as_object() {
        for name in schema["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
            if !object.contains_key(name) {
                errors.push(format!("{at}: required field {name:?} is missing"));
            }
        }
        let properties = schema["properties"].as_object();
        for (name, field) in object {
            let at = format!("{at}.{name}");
            match properties.and_then(|p| p.get(name)) {
                Some(s) => validate(doc, s, field, &at, errors),
                None => match &schema["additionalProperties"] {
                    Value::Object(_) => {
                        validate(doc, &schema["additionalProperties"], field, &at, errors)
                    }
                    // A free-form object (`{"type": "object"}` alone, e.g. capabilities).
                    Value::Null if properties.is_none() => {}
                    Value::Bool(true) => {}
                    _ => errors.push(format!("{at}: a field the document does not name")),
                },
            }
        }
    }
}
