//! Pseudo-terminals: [`Pty`] is a duplex handle on a program running on a new terminal inside
//! the sandbox. Output is what the terminal shows (stdout and stderr together); input is what
//! the user types; `resize` sends the window size (the program gets `SIGWINCH`). A pty runs on a
//! connection of its own.
//!
//! For a read loop that also forwards input, [`Pty::split`] lends the two directions separately,
//! so both can sit in one `select!`.

use crate::conn::{RelayRead, RelayWrite};
use bytes::Bytes;
use silk_proto::{Command, ExitStatus, Frame, FrameReader, FrameWriter, PtyRequest};

use crate::conn::recv;
use crate::error::{Error, Result};
use crate::sandbox::Sandbox;

/// A terminal being prepared; [`open`](Self::open) starts it.
#[derive(Debug)]
#[must_use = "a PtyBuilder does nothing until opened"]
pub struct PtyBuilder {
    sandbox: Sandbox,
    request: PtyRequest,
}

impl PtyBuilder {
    /// The program (default `/bin/sh`).
    pub fn command<I, S>(mut self, argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.request.command.argv = argv.into_iter().map(Into::into).collect();
        self
    }

    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.request.command.env.push((key.into(), value.into()));
        self
    }

    pub fn cwd(mut self, dir: impl Into<String>) -> Self {
        self.request.command.cwd = Some(dir.into());
        self
    }

    pub fn user(mut self, user: impl Into<String>) -> Self {
        self.request.command.user = Some(user.into());
        self
    }

    /// Starts the program; returns once silkd answered `Started`.
    pub async fn open(self) -> Result<Pty> {
        let mut conn = self.sandbox.dial().await?;
        conn.send(&Frame::PtyOpen(self.request)).await?;
        match conn.recv().await? {
            Frame::Started { pid } => Ok(Pty {
                output: PtyOutput { rd: Some(conn.rd), status: None },
                input: PtyInput { wr: conn.wr, pid },
            }),
            Frame::Error(e) => Err(e.into()),
            other => Err(Error::unexpected(&other, "pty open")),
        }
    }
}

/// A program on a terminal inside the sandbox.
#[derive(Debug)]
pub struct Pty {
    output: PtyOutput,
    input: PtyInput,
}

/// The terminal's output side.
#[derive(Debug)]
pub struct PtyOutput {
    rd: Option<FrameReader<RelayRead>>,
    status: Option<ExitStatus>,
}

/// The terminal's input side: keystrokes, resize, kill.
#[derive(Debug)]
pub struct PtyInput {
    wr: FrameWriter<RelayWrite>,
    pid: u32,
}

impl Pty {
    pub fn pid(&self) -> u32 {
        self.input.pid
    }

    /// Both directions at once, for a `select!` loop.
    pub fn split(&mut self) -> (&mut PtyOutput, &mut PtyInput) {
        (&mut self.output, &mut self.input)
    }

    pub async fn read(&mut self) -> Result<Option<Bytes>> {
        self.output.read().await
    }

    pub async fn write(&mut self, data: impl Into<Bytes>) -> Result<()> {
        self.input.write(data).await
    }

    pub async fn resize(&mut self, cols: u16, rows: u16) -> Result<()> {
        self.input.resize(cols, rows).await
    }

    pub async fn kill(&mut self) -> Result<()> {
        self.input.kill().await
    }

    pub fn status(&self) -> Option<ExitStatus> {
        self.output.status
    }
}

impl PtyOutput {
    /// What the terminal shows next; `None` once the program exited (see
    /// [`status`](Self::status)). Cancel-safe.
    pub async fn read(&mut self) -> Result<Option<Bytes>> {
        let Some(rd) = self.rd.as_mut() else { return Ok(None) };
        let frame = recv(rd).await;
        match frame {
            Ok(Frame::Stdout(b)) => Ok(Some(b)),
            Ok(Frame::Exit(s)) => {
                self.status = Some(s);
                self.rd = None;
                Ok(None)
            }
            Ok(Frame::Error(e)) => {
                self.rd = None;
                Err(e.into())
            }
            Ok(other) => {
                self.rd = None;
                Err(Error::unexpected(&other, "pty"))
            }
            Err(e) => {
                self.rd = None;
                Err(e)
            }
        }
    }

    pub fn status(&self) -> Option<ExitStatus> {
        self.status
    }
}

impl PtyInput {
    /// Keystrokes (a terminal has no end of input: send `\x04` for ^D).
    pub async fn write(&mut self, data: impl Into<Bytes>) -> Result<()> {
        Ok(self.wr.send(&Frame::Stdin(data.into())).await?)
    }

    /// Sets the window size.
    pub async fn resize(&mut self, cols: u16, rows: u16) -> Result<()> {
        if cols == 0 || rows == 0 {
            return Err(Error::Invalid("a terminal size cannot be zero".into()));
        }
        Ok(self.wr.send(&Frame::PtyResize { pid: self.pid, cols, rows }).await?)
    }

    /// Kills the program (the call ends with `Exit`, signal 9).
    pub async fn kill(&mut self) -> Result<()> {
        Ok(self.wr.send(&Frame::Cancel).await?)
    }
}

impl Sandbox {
    /// Prepares a terminal of `cols` × `rows`; see [`PtyBuilder`].
    pub fn pty(&self, cols: u16, rows: u16) -> PtyBuilder {
        PtyBuilder {
            sandbox: self.clone(),
            request: PtyRequest { command: Command::default(), cols, rows },
        }
    }
}
