//! envd's plain-HTTP file transfer over silkd, streamed both ways (never a whole file in
//! memory): `GET /files?path=` reads a file; `POST /files?path=` writes one from an
//! `application/octet-stream` body, or several from `multipart/form-data` parts named `file`
//! (each part's file name is its path when the query has none). Relative paths are the user's
//! home's.

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Multipart, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header as h};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures_core::Stream;
use serde::Deserialize;
use serde_json::{Value, json};
use silk_proto::{Connection, Frame, ReadRequest, WriteRequest};
use tokio::net::UnixStream;

use super::envd::{DEFAULT_USER, agent, code_of, give};
use super::{E2b, HttpError};

pub(super) fn routes() -> Router<E2b> {
    Router::new()
        .route("/files", get(read).post(write))
        // Files stream through; their size is bounded by the sandbox's disk, not the API's.
        .layer(axum::extract::DefaultBodyLimit::disable())
}

#[derive(Debug, Deserialize)]
struct FileQuery {
    path: Option<String>,
    username: Option<String>,
}

/// An envd HTTP error: `{code, message}` with the status (404 is the SDK's file not found).
fn error(status: StatusCode, message: impl Into<String>) -> HttpError {
    HttpError::new(status, message)
}

/// A Connect error from a call made for an upload, as an HTTP one.
fn refused(e: super::connect::Error) -> HttpError {
    error(StatusCode::from_u16(e.code.http_status()).expect("valid status"), e.message)
}

fn silk_error(e: silk_proto::WireError) -> HttpError {
    let status = StatusCode::from_u16(code_of(e.kind).http_status()).expect("valid status");
    error(status, e.message)
}

/// `path` made absolute: relative paths are under the user's home.
pub(super) fn absolute(path: &str, user: &str) -> String {
    if path.starts_with('/') {
        return path.to_string();
    }
    match user {
        "root" | "0" => format!("/root/{path}"),
        u => format!("/home/{u}/{path}"),
    }
}

async fn read(
    State(e2b): State<E2b>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
) -> Result<Response, HttpError> {
    let Some(path) = q.path.as_deref() else {
        return Err(error(StatusCode::BAD_REQUEST, "path is required"));
    };
    let path = absolute(path, q.username.as_deref().unwrap_or(DEFAULT_USER));
    let mut agent = match agent(&e2b, &headers).await {
        Ok(agent) => agent,
        Err(res) => return Err(res),
    };
    let request = Frame::Read(ReadRequest { path, offset: 0, len: None });
    if let Err(e) = agent.conn.send(&request).await {
        return Err(error(StatusCode::BAD_GATEWAY, format!("silkd: {e}")));
    }
    // The first frame says whether the read goes ahead; the rest stream as they come.
    let first = match agent.conn.recv().await {
        Ok(Some(Frame::Error(e))) => return Err(silk_error(e)),
        Ok(Some(frame)) => frame,
        Ok(None) => return Err(error(StatusCode::BAD_GATEWAY, "silkd closed the connection")),
        Err(e) => return Err(error(StatusCode::BAD_GATEWAY, format!("silkd: {e}"))),
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    tokio::spawn(async move {
        let mut frame = Some(first);
        loop {
            let chunk = match frame.take() {
                Some(Frame::Data(b)) => Ok(b),
                Some(Frame::Done) => return,
                Some(Frame::Error(e)) => Err(std::io::Error::other(e.to_string())),
                Some(_) => Ok(Bytes::new()),
                None => Err(std::io::Error::other("silkd closed the connection")),
            };
            let failed = chunk.is_err();
            if tx.send(chunk).await.is_err() || failed {
                return;
            }
            frame = match agent.conn.recv().await {
                Ok(f) => f,
                Err(e) => {
                    let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
                    return;
                }
            };
        }
    });
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(h::CONTENT_TYPE, "application/octet-stream")
        .body(Body::from_stream(Chunks(rx)))
        .expect("a valid response"))
}

/// A channel's chunks as a body stream.
pub(super) struct Chunks(pub tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>);

impl Stream for Chunks {
    type Item = Result<Bytes, std::io::Error>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

async fn write(
    State(e2b): State<E2b>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
    request: Request,
) -> Result<Response, HttpError> {
    let mut agent = match agent(&e2b, &headers).await {
        Ok(agent) => agent,
        Err(res) => return Err(res),
    };
    let user = q.username.as_deref().unwrap_or(DEFAULT_USER);
    let content_type = super::header(&headers, "content-type").unwrap_or_default();
    let mut written: Vec<Value> = vec![];
    if content_type.starts_with("multipart/form-data") {
        let mut multipart = match Multipart::from_request(request, &()).await {
            Ok(m) => m,
            Err(e) => return Err(error(StatusCode::BAD_REQUEST, e.body_text())),
        };
        loop {
            let mut field = match multipart.next_field().await {
                Ok(Some(field)) => field,
                Ok(None) => break,
                Err(e) => return Err(error(StatusCode::BAD_REQUEST, e.body_text())),
            };
            let named = q.path.clone().or_else(|| field.file_name().map(str::to_string));
            let Some(path) = named else {
                return Err(error(StatusCode::BAD_REQUEST, "a part without a file name or path"));
            };
            let path = absolute(&path, user);
            let sent = async {
                let mut upload = Upload::begin(&mut agent.conn, &path).await?;
                loop {
                    match field.chunk().await {
                        Ok(Some(bytes)) => upload.chunk(bytes).await?,
                        Ok(None) => break,
                        Err(e) => return Err(error(StatusCode::BAD_REQUEST, e.body_text())),
                    }
                }
                upload.finish().await
            };
            sent.await?;
            give(&mut agent.conn, &path, user).await.map_err(refused)?;
            written.push(info(&path));
        }
    } else {
        let Some(path) = q.path.as_deref() else {
            return Err(error(StatusCode::BAD_REQUEST, "path is required"));
        };
        let mut gunzip = match super::header(&headers, "content-encoding") {
            None | Some("identity") => None,
            Some("gzip") => Some(Gunzip::default()),
            Some(other) => {
                let e = format!("content-encoding {other:?}: only gzip is served");
                return Err(error(StatusCode::BAD_REQUEST, e));
            }
        };
        let path = absolute(path, user);
        let mut body = request.into_body().into_data_stream();
        let sent = async {
            let mut upload = Upload::begin(&mut agent.conn, &path).await?;
            loop {
                let next = std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_next(cx));
                let bytes = match next.await {
                    Some(Ok(bytes)) => bytes,
                    None => break,
                    Some(Err(e)) => return Err(error(StatusCode::BAD_REQUEST, e.to_string())),
                };
                match &mut gunzip {
                    None => upload.chunk(bytes).await?,
                    Some(g) => {
                        for piece in bytes.chunks(Gunzip::STEP) {
                            upload.chunk(g.feed(piece)?).await?;
                        }
                    }
                }
            }
            if let Some(g) = gunzip {
                upload.chunk(g.finish()?).await?;
            }
            upload.finish().await
        };
        sent.await?;
        give(&mut agent.conn, &path, user).await.map_err(refused)?;
        written.push(info(&path));
    }
    if written.is_empty() {
        return Err(error(StatusCode::BAD_REQUEST, "no file in the request"));
    }
    Ok((StatusCode::OK, axum::Json(Value::Array(written))).into_response())
}

fn info(path: &str) -> Value {
    let name = path.rsplit('/').next().unwrap_or(path);
    json!({ "name": name, "type": "file", "path": path })
}

/// A gzip body decompressed as it streams in. Input goes in [`STEP`](Self::STEP)-byte pieces,
/// each piece's output sent before the next is read: what one piece can expand to (about a
/// thousand times, at deflate's limit) bounds the memory an upload holds.
#[derive(Default)]
struct Gunzip(Option<flate2::write::GzDecoder<Vec<u8>>>);

impl Gunzip {
    const STEP: usize = 4096;

    fn bad(e: std::io::Error) -> HttpError {
        error(StatusCode::BAD_REQUEST, format!("gzip body: {e}"))
    }

    fn feed(&mut self, piece: &[u8]) -> Result<Bytes, HttpError> {
        use std::io::Write as _;
        let d = self.0.get_or_insert_with(|| flate2::write::GzDecoder::new(Vec::new()));
        d.write_all(piece).map_err(Self::bad)?;
        Ok(std::mem::take(d.get_mut()).into())
    }

    /// What is left once the body ended; a truncated stream is an error, not a short file.
    fn finish(self) -> Result<Bytes, HttpError> {
        let Some(d) = self.0 else {
            return Err(Self::bad(std::io::ErrorKind::UnexpectedEof.into()));
        };
        d.finish().map(Bytes::from).map_err(Self::bad)
    }
}

/// Writes one file as silkd's `Write`: [`begin`](Self::begin), a [`chunk`](Self::chunk) per piece,
/// [`finish`](Self::finish) (the file is replaced only once it is whole; a write never
/// finished leaves the old one).
struct Upload<'c> {
    conn: &'c mut Connection<UnixStream>,
}

fn gone(e: silk_proto::ProtoError) -> HttpError {
    error(StatusCode::BAD_GATEWAY, format!("silkd: {e}"))
}

impl<'c> Upload<'c> {
    async fn begin(conn: &'c mut Connection<UnixStream>, path: &str) -> Result<Self, HttpError> {
        let request = WriteRequest { path: path.to_string(), mode: None, parents: true };
        conn.send(&Frame::Write(request)).await.map_err(gone)?;
        Ok(Upload { conn })
    }

    async fn chunk(&mut self, bytes: Bytes) -> Result<(), HttpError> {
        if bytes.is_empty() {
            return Ok(());
        }
        self.conn.send(&Frame::Data(bytes)).await.map_err(gone)
    }

    async fn finish(self) -> Result<(), HttpError> {
        self.conn.send(&Frame::Eof).await.map_err(gone)?;
        loop {
            match self.conn.recv().await.map_err(gone)? {
                Some(Frame::Done) => return Ok(()),
                Some(Frame::Error(e)) => return Err(silk_error(e)),
                Some(_) => {}
                None => return Err(error(StatusCode::BAD_GATEWAY, "silkd closed the connection")),
            }
        }
    }
}
