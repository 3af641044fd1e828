//! [`ChunkAssembler`]: joins the [`RecoveryChunk`]s of one reply back into a
//! [`RecoveryReply`], checking their order, that they belong together, and that the
//! reply stays within the receiver's [`ReplyLimits`].
//!
//! The limits are checked before a chunk is decoded or accumulated, so a publisher
//! that answers with an endless or huge reply costs the receiver at most
//! `max_bytes` of payload and `max_chunks` messages, never unbounded memory.

use super::{RecoveryBody, RecoveryChunk, RecoveryReply};

/// The most a receiver takes in one recovery reply. Default: 4,096 chunks and
/// 256 MiB of payload — a dump of about 5M blocks at ~45 bytes each, far above a
/// real rank's cache (publishers cut chunks at 4,096 blocks, ~200 KB, by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyLimits {
    /// Most chunks (messages) per reply; at least 1.
    pub max_chunks: u32,
    /// Most payload bytes per reply, summed over its chunks (encoded msgpack).
    pub max_bytes: usize,
}

impl Default for ReplyLimits {
    fn default() -> Self {
        Self {
            max_chunks: 4096,
            max_bytes: 256 << 20,
        }
    }
}

/// Why a sequence of chunks does not form a reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssemblyError {
    /// A chunk arrived out of order or twice.
    #[error("recovery chunk {got} arrived where chunk {expected} was expected")]
    OutOfOrder {
        /// The chunk number that was due.
        expected: u32,
        /// The chunk number received.
        got: u32,
    },
    /// A chunk's header or body kind differs from chunk 0's.
    #[error("recovery chunk {0} does not match the reply's header or body kind")]
    Mismatch(u32),
    /// The reply has more chunks than [`ReplyLimits::max_chunks`]; refused before
    /// the extra chunk was decoded.
    #[error("recovery reply has more than {limit} chunks")]
    TooManyChunks {
        /// The limit.
        limit: u32,
    },
    /// The reply's payload exceeds [`ReplyLimits::max_bytes`]; refused before the
    /// chunk that crossed it was decoded.
    #[error("recovery reply exceeds {limit} bytes")]
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// A chunk's payload is not a msgpack [`RecoveryChunk`].
    #[error("recovery chunk does not decode: {0}")]
    Malformed(String),
}

impl AssemblyError {
    /// A short lowercase name, for log fields and metric labels: `out_of_order`,
    /// `mismatch`, `too_many_chunks`, `too_large` or `malformed`.
    pub fn reason(&self) -> &'static str {
        match self {
            AssemblyError::OutOfOrder { .. } => "out_of_order",
            AssemblyError::Mismatch(_) => "mismatch",
            AssemblyError::TooManyChunks { .. } => "too_many_chunks",
            AssemblyError::TooLarge { .. } => "too_large",
            AssemblyError::Malformed(_) => "malformed",
        }
    }

    /// Whether the reply was refused for its size (it would be as large again if
    /// asked again), rather than for a damaged chunk.
    pub fn is_oversized(&self) -> bool {
        matches!(
            self,
            AssemblyError::TooManyChunks { .. } | AssemblyError::TooLarge { .. }
        )
    }
}

/// Joins [`RecoveryChunk`]s back into a [`RecoveryReply`]. After an error the
/// assembler is unusable; start a new one.
#[derive(Debug, Default)]
pub struct ChunkAssembler {
    reply: Option<RecoveryReply>,
    next_chunk: u32,
    bytes: usize,
    limits: ReplyLimits,
}

impl ChunkAssembler {
    /// An assembler expecting chunk 0, with the default [`ReplyLimits`].
    pub fn new() -> Self {
        Self::default()
    }

    /// An assembler expecting chunk 0 that refuses replies beyond `limits`.
    pub fn with_limits(limits: ReplyLimits) -> Self {
        Self {
            limits,
            ..Self::default()
        }
    }

    /// Checks the chunk and byte limits for one more chunk of `bytes` payload bytes,
    /// and counts it.
    fn admit(&mut self, bytes: usize) -> Result<(), AssemblyError> {
        if self.next_chunk >= self.limits.max_chunks {
            return Err(AssemblyError::TooManyChunks {
                limit: self.limits.max_chunks,
            });
        }
        let total = self.bytes.saturating_add(bytes);
        if total > self.limits.max_bytes {
            return Err(AssemblyError::TooLarge {
                limit: self.limits.max_bytes,
            });
        }
        self.bytes = total;
        Ok(())
    }

    /// Takes the next chunk as it came off the wire: the limits are checked on its
    /// size first, then it is decoded and added as by [`ChunkAssembler::push`].
    ///
    /// # Errors
    /// [`AssemblyError::TooManyChunks`] or [`AssemblyError::TooLarge`] (nothing
    /// decoded), [`AssemblyError::Malformed`], or what [`ChunkAssembler::push`]
    /// refuses.
    pub fn push_payload(&mut self, payload: &[u8]) -> Result<Option<RecoveryReply>, AssemblyError> {
        self.admit(payload.len())?;
        let chunk: RecoveryChunk =
            crate::decode(payload).map_err(|e| AssemblyError::Malformed(e.to_string()))?;
        self.add(chunk)
    }

    /// Adds the next chunk (already decoded: only the chunk limit applies); returns
    /// the whole reply once the last chunk is in.
    ///
    /// # Errors
    /// [`AssemblyError`] for a chunk out of order, one whose header or body kind
    /// differs from chunk 0's, or one past [`ReplyLimits::max_chunks`].
    pub fn push(&mut self, chunk: RecoveryChunk) -> Result<Option<RecoveryReply>, AssemblyError> {
        self.admit(0)?;
        self.add(chunk)
    }

    fn add(&mut self, chunk: RecoveryChunk) -> Result<Option<RecoveryReply>, AssemblyError> {
        if chunk.chunk != self.next_chunk {
            return Err(AssemblyError::OutOfOrder {
                expected: self.next_chunk,
                got: chunk.chunk,
            });
        }
        self.next_chunk += 1;
        match &mut self.reply {
            None => {
                self.reply = Some(RecoveryReply {
                    worker_id: chunk.worker_id,
                    dp_rank: chunk.dp_rank,
                    epoch: chunk.epoch,
                    next_event_id: chunk.next_event_id,
                    body: chunk.body,
                });
            }
            Some(reply) => {
                let same_header = reply.worker_id == chunk.worker_id
                    && reply.dp_rank == chunk.dp_rank
                    && reply.epoch == chunk.epoch
                    && reply.next_event_id == chunk.next_event_id;
                if !same_header || reply.body.kind() != chunk.body.kind() {
                    return Err(AssemblyError::Mismatch(chunk.chunk));
                }
                match (&mut reply.body, chunk.body) {
                    (RecoveryBody::Events { events }, RecoveryBody::Events { events: more }) => {
                        events.extend(more)
                    }
                    (
                        RecoveryBody::Dump {
                            chains,
                            unheld,
                            unheld_in_groups,
                        },
                        RecoveryBody::Dump {
                            chains: more,
                            unheld: more_unheld,
                            unheld_in_groups: more_in_groups,
                        },
                    ) => {
                        chains.extend(more);
                        unheld.extend(more_unheld);
                        unheld_in_groups.extend(more_in_groups);
                    }
                    _ => return Err(AssemblyError::Mismatch(chunk.chunk)),
                }
            }
        }
        if chunk.last {
            Ok(self.reply.take())
        } else {
            Ok(None)
        }
    }
}
