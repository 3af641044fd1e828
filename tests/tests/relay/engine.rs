//! The fake engine of `relay.rs`: the engine's side of vLLM's KV-event wire in
//! Rust (a publisher socket and a replay ROUTER socket), the captured frames, and a
//! fixed Prometheus page. Its replay socket can answer requests with messages left
//! out, as vLLM's does when its send queue is full ([`Lossy`]).

use bytes::Bytes;
use serde_json::Value;
use std::sync::{Arc, Mutex};
use tokio::task::JoinHandle;
use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, XPubSocket, ZmqMessage};

pub fn fixture(name: &str) -> Value {
    let path = format!(
        "{}/../kv-events/tests/fixtures/engines/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn unhex(s: &str) -> Bytes {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect::<Vec<u8>>()
        .into()
}

/// The payloads of a fixture file, in order.
pub fn payloads(name: &str) -> Vec<Bytes> {
    let doc = fixture(name);
    let list = doc.get("frames").or_else(|| doc.get("payloads")).unwrap();
    list.as_array()
        .unwrap()
        .iter()
        .map(|f| unhex(f["payload_hex"].as_str().unwrap()))
        .collect()
}

/// How the fake engine frames replay replies.
#[derive(Clone, Copy)]
pub enum ReplayFraming {
    /// vLLM ≥ 0.28 and SGLang: `["", topic, seq, payload]`.
    WithTopic,
    /// vLLM ≤ 0.25: `["", seq, payload]`.
    Legacy,
}

pub type Buffer = Arc<Mutex<Vec<(u64, Bytes)>>>;

/// What the replay socket leaves out of its answer to one request, as vLLM's does:
/// its ROUTER socket drops whole messages, silently, once the reader is a send
/// high-water mark behind (a hole), up to the end marker.
#[derive(Debug, Clone, Default)]
pub struct Lossy {
    /// Seqs of the buffer not sent.
    pub dropped: std::ops::Range<u64>,
    /// The end marker is not sent either.
    pub end_marker_dropped: bool,
}

/// The replay socket's state: the buffer, the answers to make lossy (one per request,
/// in order; later requests are answered whole), and the start seq of each request.
#[derive(Clone, Default)]
pub struct ReplayState {
    pub buffer: Buffer,
    pub lossy: Arc<Mutex<std::collections::VecDeque<Lossy>>>,
    pub requests: Arc<Mutex<Vec<u64>>>,
}

/// The engine's side of the wire.
pub struct FakeEngine {
    publisher: XPubSocket,
    pub pub_endpoint: String,
    pub replay_endpoint: String,
    /// The engine's Prometheus page ([`VLLM_METRICS`]), as vLLM serves it.
    pub metrics_url: String,
    pub topic: Bytes,
    buffer: Buffer,
    replay: ReplayState,
    replay_task: JoinHandle<()>,
    page_task: JoinHandle<()>,
}

pub fn message(frames: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(frames).unwrap()
}

impl FakeEngine {
    /// The `kv-router relay` flags that read this engine as worker 7; the relay
    /// learns 16-token blocks and 1,000 blocks per rank from the engine's page.
    pub fn relay_flags(&self) -> Vec<String> {
        let mut flags = self.relay_flags_without_page();
        flags.extend(["--metrics-url".to_owned(), self.metrics_url.clone()]);
        flags
    }

    /// [`Self::relay_flags`] without the metrics page: the relay learns the block
    /// size from the first stored event, and no capacity.
    pub fn relay_flags_without_page(&self) -> Vec<String> {
        let topic = String::from_utf8(self.topic.to_vec()).unwrap();
        [
            "--engine-endpoint",
            self.pub_endpoint.as_str(),
            "--replay-endpoint",
            self.replay_endpoint.as_str(),
            "--topic",
            topic.as_str(),
            "--worker-id",
            "7",
            "--worker-name",
            "relay-7",
        ]
        .map(str::to_owned)
        .to_vec()
    }

    pub async fn start(topic: &str, framing: ReplayFraming) -> Self {
        let mut publisher = XPubSocket::new();
        let pub_endpoint = publisher
            .bind("tcp://127.0.0.1:0")
            .await
            .unwrap()
            .to_string();
        let mut router = RouterSocket::new();
        let replay_endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let replay = ReplayState::default();
        let buffer = replay.buffer.clone();
        let topic = Bytes::copy_from_slice(topic.as_bytes());
        let replay_task =
            tokio::spawn(serve_replay(router, replay.clone(), topic.clone(), framing));
        let (metrics_url, page_task) = serve_page(VLLM_METRICS.to_owned()).await;
        Self {
            publisher,
            pub_endpoint,
            replay_endpoint,
            metrics_url,
            topic,
            buffer,
            replay,
            replay_task,
            page_task,
        }
    }

    /// Waits for the relay's subscription (`\x01` + topic).
    pub async fn wait_subscribed(&mut self) {
        loop {
            let msg = self.publisher.recv().await.unwrap();
            if msg.get(0).is_some_and(|f| f.first() == Some(&1)) {
                return;
            }
        }
    }

    /// Publishes batch `seq` (and keeps it in the replay buffer).
    pub async fn publish(&mut self, seq: u64, payload: &Bytes) {
        self.buffer_only(seq, payload);
        let frames = vec![
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ];
        self.publisher.send(message(frames)).await.unwrap();
    }

    /// Buffers batch `seq` without sending it: lost in transit.
    pub fn buffer_only(&self, seq: u64, payload: &Bytes) {
        self.buffer.lock().unwrap().push((seq, payload.clone()));
    }

    /// Answers the next replay requests, one entry each, with messages left out.
    pub fn drop_from_replies(&self, plan: Vec<Lossy>) {
        self.replay.lossy.lock().unwrap().extend(plan);
    }

    /// The start seq of every replay request so far, in order.
    pub fn replay_requests(&self) -> Vec<u64> {
        self.replay.requests.lock().unwrap().clone()
    }

    /// Empties the replay buffer (an engine whose buffer no longer reaches back).
    pub fn forget(&self) {
        self.buffer.lock().unwrap().clear();
    }

    pub fn stop(self) {
        self.replay_task.abort();
        self.page_task.abort();
    }
}

/// Serves `["", start_seq]` requests from the buffer, ended by a seq of -1, leaving
/// out what the state's next [`Lossy`] says. A reader that went away mid-answer ends
/// the answer, as its messages are then dropped.
pub async fn serve_replay(
    mut router: RouterSocket,
    state: ReplayState,
    topic: Bytes,
    framing: ReplayFraming,
) {
    while let Ok(request) = router.recv().await {
        let frames = request.into_vec();
        let (id, start) = (frames[0].clone(), &frames[2]);
        let start = u64::from_be_bytes(start[..].try_into().unwrap());
        state.requests.lock().unwrap().push(start);
        let lossy = state.lossy.lock().unwrap().pop_front().unwrap_or_default();
        let batches: Vec<(u64, Bytes)> = state
            .buffer
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, _)| *s >= start && !lossy.dropped.contains(s))
            .cloned()
            .collect();
        let reply = |seq: Bytes, payload: Bytes, topic: Bytes| match framing {
            ReplayFraming::WithTopic => vec![id.clone(), Bytes::new(), topic, seq, payload],
            ReplayFraming::Legacy => vec![id.clone(), Bytes::new(), seq, payload],
        };
        let mut messages: Vec<Vec<Bytes>> = batches
            .into_iter()
            .map(|(seq, payload)| {
                reply(
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                    topic.clone(),
                )
            })
            .collect();
        if !lossy.end_marker_dropped {
            messages.push(reply(
                Bytes::from_static(&[0xff; 8]),
                Bytes::new(),
                Bytes::new(),
            ));
        }
        for frames in messages {
            if router.send(message(frames)).await.is_err() {
                break;
            }
        }
    }
}

/// A vLLM-style Prometheus page: running, waiting and KV usage, and the cache
/// configuration (16-token blocks, 1,000 blocks).
pub const VLLM_METRICS: &str = "# TYPE vllm:num_requests_running gauge\n\
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"1000\"} 1.0\n";

/// Serves `page` over HTTP/1.1 on a free port; returns its URL and the server task.
pub async fn serve_page(page: String) -> (String, JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request).await;
            let response = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
                page.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
        }
    });
    (url, task)
}
