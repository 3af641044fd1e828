//! SGLang's bootstrap handshake, mocked: an SGLang prefill worker serves a small HTTP
//! endpoint on its bootstrap port where a decode worker waits for a request's room.
//!
//! The frontend sends a request to both workers at once, so either may arrive first.
//! A room is created by whichever asks first: the prefill request claims it
//! ([`Rooms::claim`]) and marks it ready once its prompt is prefilled, or failed when
//! the request ends otherwise; the decode worker long-polls it
//! (`GET /rooms/{room}?wait_ms=N`, [`fetch`]) and gets the prefilled prompt's block
//! ids (200), the prefill's failure (410), or nothing yet within `wait_ms` (408, it
//! asks again until its own deadline). A ready room is handed to one decode and
//! forgotten. Real SGLang exchanges this over its bootstrap server and the transfer
//! engine's own channel; the mock keeps only what the decode needs to know.
//!
//! Bounds: at most [`MAX_ROOMS`] rooms open per worker (more is a 503), each
//! forgotten [`ROOM_TTL`] after it was opened whatever its state (a decode that never
//! came, a prefill that never came); one long-poll waits at most [`MAX_POLL`]. Cost:
//! one watch channel per room, one short lock per claim, poll and mark.

use super::super::openai::EngineApiError;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Most rooms one prefill worker keeps open.
pub const MAX_ROOMS: usize = 65_536;
/// How long a room is kept after it was opened, ready or not.
pub const ROOM_TTL: Duration = Duration::from_secs(300);
/// The longest one long-poll waits before it answers 408.
pub const MAX_POLL: Duration = Duration::from_secs(60);
/// Largest answer a decode worker reads from a bootstrap server, in bytes.
const MAX_ANSWER_BYTES: usize = 4 << 20;

/// What a decode worker learns of a ready room.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoomReady {
    /// The room.
    pub bootstrap_room: u64,
    /// The prefill worker's engine id.
    pub engine_id: String,
    /// The prefilled prompt's length, in tokens.
    pub prompt_tokens: u64,
    /// The prefilled prompt's block ids (chained block hashes, the last block may
    /// be partial).
    pub block_ids: Vec<u64>,
}

#[derive(Debug, Clone)]
enum RoomState {
    Pending,
    Ready(Arc<RoomReady>),
    Failed(String),
}

#[derive(Debug)]
struct Entry {
    state: watch::Sender<RoomState>,
    opened: Instant,
    claimed: bool,
}

#[derive(Debug, Default)]
struct Inner {
    rooms: HashMap<u64, Entry>,
    /// Rooms in the order they were opened, for expiry (stale items are skipped).
    opened: VecDeque<(Instant, u64)>,
}

/// The rooms of one SGLang prefill worker.
#[derive(Debug, Default)]
pub struct Rooms {
    inner: Mutex<Inner>,
}

/// Why a room could not be opened.
fn full() -> EngineApiError {
    EngineApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: format!("too many bootstrap rooms open (at most {MAX_ROOMS})"),
    }
}

impl Inner {
    /// Forgets rooms older than [`ROOM_TTL`]; compacts the expiry queue when stale
    /// items outnumber the rooms.
    fn expire(&mut self, now: Instant) {
        while let Some(&(opened, room)) = self.opened.front() {
            if opened + ROOM_TTL > now {
                break;
            }
            self.opened.pop_front();
            if self.rooms.get(&room).is_some_and(|e| e.opened == opened) {
                self.rooms.remove(&room);
            }
        }
        if self.opened.len() > 2 * MAX_ROOMS {
            let rooms = &self.rooms;
            self.opened
                .retain(|(opened, room)| rooms.get(room).is_some_and(|e| e.opened == *opened));
        }
    }

    /// The entry of `room`, opened if absent.
    fn open(&mut self, room: u64) -> Result<&mut Entry, EngineApiError> {
        let now = Instant::now();
        self.expire(now);
        if !self.rooms.contains_key(&room) {
            if self.rooms.len() >= MAX_ROOMS {
                return Err(full());
            }
            self.opened.push_back((now, room));
        }
        Ok(self.rooms.entry(room).or_insert_with(|| Entry {
            state: watch::channel(RoomState::Pending).0,
            opened: now,
            claimed: false,
        }))
    }
}

impl Rooms {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Plain data, consistent between statements: a poisoned lock is usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The prefill request of `room` claims it; the claim marks it ready or failed.
    ///
    /// # Errors
    /// 409 when another prefill request claimed the room already; 503 at
    /// [`MAX_ROOMS`].
    pub fn claim(self: &Arc<Self>, room: u64) -> Result<RoomClaim, EngineApiError> {
        let mut inner = self.lock();
        let entry = inner.open(room)?;
        if entry.claimed {
            return Err(EngineApiError {
                status: StatusCode::CONFLICT,
                message: format!("bootstrap_room {room} is already in use by another request"),
            });
        }
        entry.claimed = true;
        Ok(RoomClaim {
            rooms: self.clone(),
            room,
            done: false,
        })
    }

    fn mark(&self, room: u64, state: RoomState) {
        if let Ok(entry) = self.lock().open(room) {
            entry.claimed = true;
            entry.state.send_replace(state);
        }
    }

    /// Waits up to `wait` for `room` to be ready or failed. A ready or failed room is
    /// then forgotten (one decode per room); a room nobody claimed or waits for any
    /// more is forgotten at the deadline.
    async fn wait(&self, room: u64, wait: Duration) -> Result<Option<RoomState>, EngineApiError> {
        let mut rx = self.lock().open(room)?.state.subscribe();
        let settled = rx.wait_for(|s| !matches!(s, RoomState::Pending));
        let state = match tokio::time::timeout(wait, settled).await {
            Ok(Ok(state)) => Some(state.clone()),
            // Expired under us (its sender dropped), or the deadline passed.
            Ok(Err(_)) | Err(_) => None,
        };
        drop(rx);
        let mut inner = self.lock();
        let forget = inner.rooms.get(&room).is_some_and(|e| match state {
            Some(_) => true,
            None => !e.claimed && e.state.receiver_count() == 0,
        });
        if forget {
            inner.rooms.remove(&room);
        }
        Ok(state)
    }
}

/// A prefill request's hold on its room: [`RoomClaim::ready`] once prefilled; if
/// dropped otherwise (the request failed or its client left), the room fails.
#[derive(Debug)]
pub struct RoomClaim {
    rooms: Arc<Rooms>,
    room: u64,
    done: bool,
}

impl RoomClaim {
    /// The prompt is prefilled: the waiting decode gets `ready`.
    pub fn ready(mut self, ready: RoomReady) {
        self.done = true;
        self.rooms
            .mark(self.room, RoomState::Ready(Arc::new(ready)));
    }

    /// The prefill failed: the waiting decode fails with `reason`.
    pub fn fail(mut self, reason: String) {
        self.done = true;
        self.rooms.mark(self.room, RoomState::Failed(reason));
    }
}

impl Drop for RoomClaim {
    fn drop(&mut self) {
        if !self.done {
            let reason = "the prefill request ended before its prompt was prefilled";
            self.rooms
                .mark(self.room, RoomState::Failed(reason.to_owned()));
        }
    }
}

#[derive(Debug, Deserialize)]
struct PollQuery {
    /// How long to wait, in ms (capped at [`MAX_POLL`]).
    wait_ms: Option<u64>,
}

/// The bootstrap server's routes: `GET /rooms/{room}?wait_ms=N`. A poll still
/// waiting when `shutdown` fires answers 503 at once, so the server stops promptly.
pub fn router(rooms: Arc<Rooms>, shutdown: CancellationToken) -> Router {
    Router::new()
        .route("/rooms/{room}", get(poll))
        .with_state((rooms, shutdown))
}

async fn poll(
    State((rooms, shutdown)): State<(Arc<Rooms>, CancellationToken)>,
    Path(room): Path<u64>,
    Query(query): Query<PollQuery>,
) -> Response {
    let wait = Duration::from_millis(query.wait_ms.unwrap_or(0)).min(MAX_POLL);
    let waited = tokio::select! {
        waited = rooms.wait(room, wait) => waited,
        () = shutdown.cancelled() => {
            let stopping = "the prefill engine is shutting down";
            return (StatusCode::SERVICE_UNAVAILABLE, stopping).into_response();
        }
    };
    match waited {
        Ok(Some(RoomState::Ready(ready))) => axum::Json(ready.as_ref().clone()).into_response(),
        Ok(Some(RoomState::Failed(reason))) => (StatusCode::GONE, reason).into_response(),
        Ok(Some(RoomState::Pending) | None) => (
            StatusCode::REQUEST_TIMEOUT,
            format!("room {room} is not prefilled yet"),
        )
            .into_response(),
        Err(e) => (e.status, e.message).into_response(),
    }
}

/// Why a decode worker got no room.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    /// The room was not ready by the deadline.
    #[error("bootstrap room {room} was not prefilled on {url} within {waited_ms} ms")]
    Timeout {
        /// The room.
        room: u64,
        /// The bootstrap server.
        url: String,
        /// The whole wait, in ms.
        waited_ms: u128,
    },
    /// The bootstrap server said the prefill failed, or answered otherwise.
    #[error("bootstrap server {url} answered room {room}: {reason}")]
    Refused {
        /// The room.
        room: u64,
        /// The bootstrap server.
        url: String,
        /// Its answer.
        reason: String,
    },
    /// The engines are stopping.
    #[error("engine shutting down")]
    ShuttingDown,
}

/// Long-polls `room` on the bootstrap server `http://{host}:{port}` until it is
/// ready, failed, or `deadline` passes (each poll at most [`MAX_POLL`], plus a
/// 2 s grace for the answer to arrive), or `shutdown` fires.
///
/// # Errors
/// [`FetchError`].
pub async fn fetch(
    client: &reqwest::Client,
    (host, port, room): (&str, u16, u64),
    timeout: Duration,
    shutdown: &CancellationToken,
) -> Result<RoomReady, FetchError> {
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    let base = format!("http://{host}:{port}");
    let deadline = Instant::now() + timeout;
    let refused = |reason: String| FetchError::Refused {
        room,
        url: base.clone(),
        reason,
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(FetchError::Timeout {
                room,
                url: base.clone(),
                waited_ms: timeout.as_millis(),
            });
        }
        let wait = left.min(MAX_POLL);
        let url = format!("{base}/rooms/{room}?wait_ms={}", wait.as_millis());
        let ask = async {
            let response = client
                .get(&url)
                .timeout(wait + Duration::from_secs(2))
                .send()
                .await
                .map_err(|e| refused(format!("unreachable: {e}")))?;
            let status = response.status();
            let body = kv_cluster::http::client::read_body(response, MAX_ANSWER_BYTES)
                .await
                .map_err(refused)?;
            Ok::<_, FetchError>((status, body))
        };
        let (status, body) = tokio::select! {
            () = shutdown.cancelled() => return Err(FetchError::ShuttingDown),
            answer = ask => answer?,
        };
        match status {
            StatusCode::OK => {
                return serde_json::from_slice(&body)
                    .map_err(|e| refused(format!("an unreadable room: {e}")));
            }
            StatusCode::REQUEST_TIMEOUT => {}
            _ => {
                let text = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
                return Err(refused(format!("{status}: {text}")));
            }
        }
    }
}
