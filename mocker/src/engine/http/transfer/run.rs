//! Carrying out a [`Plan`]: submit the request to its rank as its half needs, and
//! answer it.

use super::parse::plan;
use super::rooms::{FetchError, RoomReady, fetch};
use super::{Plan, block_ids, engine_id};
use crate::engine::http::EngineHttpState;
use crate::engine::http::accepted::{Accepted, engine_error};
use crate::engine::http::completions::{Admission, Submission, admit, answer, submit};
use crate::engine::http::metrics::KvConnector;
use crate::engine::http::openai::EngineApiError;
use crate::engine::progress::Progress;
use crate::engine::rank::SHUTTING_DOWN;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::sync::Arc;

/// Serves one completion or chat request, in whichever half its fields and the
/// worker's role make it.
pub(in crate::engine::http) async fn serve(
    state: Arc<EngineHttpState>,
    headers: HeaderMap,
    submission: Submission,
) -> Response {
    let stream = submission.stream;
    match accept(&state, &headers, submission).await {
        Ok(accepted) => answer(state, accepted, stream).await,
        Err(e) => e.into_response(),
    }
}

async fn accept(
    state: &EngineHttpState,
    headers: &HeaderMap,
    mut submission: Submission,
) -> Result<Accepted, EngineApiError> {
    let side = &state.transfer;
    let prompt_blocks = (submission.tokens.len() as u64).div_ceil(u64::from(state.block_size));
    let plan = plan(side, &submission.transfer, submission.stream, prompt_blocks)?;
    if matches!(plan, Plan::BootstrapPrefill { .. }) {
        // SGLang's prefill server computes the prompt and its first token only.
        submission.max_tokens = Some(1);
    }
    // An SGLang prefill holds its room from here: a refusal fails the room, so
    // the decode waiting for it fails at once.
    let claim = match (&plan, &side.rooms) {
        (Plan::BootstrapPrefill { room }, Some(rooms)) => Some(rooms.claim(*room)?),
        _ => None,
    };
    let admission = match admit(state, headers, submission) {
        Ok(admission) => admission,
        Err(e) => {
            if let Some(claim) = claim {
                claim.fail(e.message.clone());
            }
            return Err(e);
        }
    };
    let connector = if side.placement.kv_transfer.is_some() {
        KvConnector::Queried
    } else {
        KvConnector::Absent
    };
    match plan {
        Plan::Local => submit(state, admission, connector),
        Plan::RemoteDecode => {
            let params = json!({
                "do_remote_prefill": true,
                "do_remote_decode": false,
                "remote_block_ids": prompt_ids(state, &admission),
                "remote_engine_id": engine_id(state.worker_id, admission.rank),
                "remote_host": side.host,
                "remote_port": side.port,
                "tp_size": 1,
            });
            let mut accepted = submit(state, admission, connector)?;
            accepted.kv_transfer_params = Some(params);
            Ok(accepted)
        }
        Plan::BootstrapPrefill { room } => {
            // Only an SGLang prefill worker, which has rooms, plans this.
            let claim = claim.ok_or_else(|| {
                EngineApiError::bad_request("this engine serves no bootstrap rooms")
            })?;
            let ready = RoomReady {
                bootstrap_room: room,
                engine_id: engine_id(state.worker_id, admission.rank),
                prompt_tokens: admission.request.prompt_tokens,
                block_ids: prompt_ids(state, &admission),
            };
            let accepted = match submit(state, admission, connector) {
                Ok(accepted) => accepted,
                Err(e) => {
                    claim.fail(e.message.clone());
                    return Err(e);
                }
            };
            let mut rx = accepted.rx.clone();
            // Ends with the request: its progress sender goes when it finishes or
            // is aborted, and a dropped claim fails the room.
            tokio::spawn(async move {
                let prefilled = rx
                    .wait_for(|p: &Progress| p.cached_tokens.is_some() || p.error.is_some())
                    .await
                    .map(|p| p.error.clone());
                match prefilled {
                    Ok(None) => claim.ready(ready),
                    Ok(Some(error)) => claim.fail(error),
                    Err(_) => drop(claim),
                }
            });
            Ok(accepted)
        }
        Plan::RemotePrefill { block_ids: remote } => {
            check_blocks(
                state,
                &admission,
                &remote,
                "kv_transfer_params.remote_block_ids",
            )?;
            pull(state, &admission).await?;
            submit(state, admission, KvConnector::Loaded)
        }
        Plan::BootstrapDecode { host, port, room } => {
            // Only an SGLang decode worker, which has a client, plans this.
            let client = side.client.as_ref().ok_or_else(|| {
                EngineApiError::bad_request("this engine waits for no bootstrap rooms")
            })?;
            let ready = fetch(
                client,
                (&host, port, room),
                side.bootstrap_timeout,
                &side.shutdown,
            )
            .await
            .map_err(|e| match e {
                FetchError::ShuttingDown => engine_error(SHUTTING_DOWN),
                // As SGLang's decode aborts a request whose transfer failed.
                e => EngineApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: format!("kv transfer failed: {e}"),
                },
            })?;
            check_blocks(state, &admission, &ready.block_ids, "bootstrap_room")?;
            pull(state, &admission).await?;
            submit(state, admission, KvConnector::Loaded)
        }
    }
}

/// The block ids of the admitted prompt.
fn prompt_ids(state: &EngineHttpState, admission: &Admission) -> Vec<u64> {
    let tokens = admission.request.token_ids.as_deref().unwrap_or_default();
    block_ids(tokens, state.block_size)
}

/// The prefill side's block ids must be this prompt's.
fn check_blocks(
    state: &EngineHttpState,
    admission: &Admission,
    remote: &[u64],
    field: &str,
) -> Result<(), EngineApiError> {
    if prompt_ids(state, admission) == remote {
        return Ok(());
    }
    Err(EngineApiError::bad_request(format!(
        "{field} belongs to another prompt: its {} blocks are not this prompt's",
        remote.len()
    )))
}

/// Waits the transfer time of the prompt blocks the request's rank does not cache
/// (in wall time: model time over `--time-scale`), as a decode worker's KV read runs
/// while its batch keeps stepping.
async fn pull(state: &EngineHttpState, admission: &Admission) -> Result<(), EngineApiError> {
    let side = &state.transfer;
    let request = &admission.request;
    let blocks =
        state.ranks[admission.rank].transfer_blocks(&request.block_hashes, request.prompt_tokens);
    let model_ms = side.cost.duration_ms(blocks, state.block_size);
    tokio::select! {
        () = tokio::time::sleep(side.runtime.wall_duration(model_ms)) => Ok(()),
        () = side.shutdown.cancelled() => Err(engine_error(SHUTTING_DOWN)),
    }
}
