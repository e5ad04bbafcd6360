//! What a stdio MCP server keeps for its one client: the sandboxes it created, their leases
//! renewed while it runs, and released when it ends (unless created with `keep`). A server
//! that is killed leaves them to run out their leases.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::Client;

#[derive(Debug, Clone, Copy)]
struct Created {
    lease_seconds: u64,
    keep: bool,
}

/// The sandboxes one stdio server created.
pub struct Session {
    client: Client,
    created: Mutex<BTreeMap<String, Created>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the client: its key stays out of logs.
        f.debug_struct("Session").field("holding", &self.holding()).finish_non_exhaustive()
    }
}

impl Session {
    pub fn new(client: Client) -> Arc<Session> {
        Arc::new(Session { client, created: Mutex::default() })
    }

    fn created_map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Created>> {
        self.created.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn created(&self, id: &str, lease_seconds: u64, keep: bool) {
        self.created_map().insert(id.to_string(), Created { lease_seconds, keep });
    }

    pub(super) fn released(&self, id: &str) {
        self.created_map().remove(id);
    }

    /// The ids it holds now, and whether each is kept at the end.
    pub fn holding(&self) -> Vec<(String, bool)> {
        self.created_map().iter().map(|(id, c)| (id.clone(), c.keep)).collect()
    }

    /// Renews every lease it holds to its full length, every `every`, until the session is
    /// dropped by everyone else. A sandbox gone meanwhile (released elsewhere) is forgotten.
    pub fn keep_alive(self: &Arc<Session>, every: Duration) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(s) = weak.upgrade() else { return };
                let held: Vec<(String, Created)> =
                    s.created_map().iter().map(|(id, c)| (id.clone(), *c)).collect();
                for (id, c) in held {
                    let renewed = async {
                        let sb = s.client.sandbox(&id, None).await?;
                        sb.renew(Duration::from_secs(c.lease_seconds.max(60))).await
                    };
                    if let Err(crate::Error::Api { status: 404, .. }) = renewed.await {
                        s.released(&id);
                    }
                }
            }
        })
    }

    /// Releases what it created and was not asked to keep, all at once (a client stopping its
    /// server gives it little time); returns the ids released.
    pub async fn close(&self) -> Vec<String> {
        let mut set = tokio::task::JoinSet::new();
        for (id, keep) in self.holding() {
            if keep {
                continue;
            }
            let client = self.client.clone();
            set.spawn(async move {
                let gone = async { client.sandbox(&id, None).await?.release().await };
                match gone.await {
                    Ok(()) | Err(crate::Error::Api { status: 404, .. }) => Some(id),
                    Err(_) => None, // left to its lease
                }
            });
        }
        let mut released = vec![];
        while let Some(done) = set.join_next().await {
            released.extend(done.ok().flatten());
        }
        released.sort();
        released
    }
}
