//! A request's transfer fields, checked against the worker's role and protocol into
//! a [`Plan`]. Every field is read from the raw JSON by hand so a bad one is a 400
//! naming it (`kv_transfer_params.remote_port must be …`), and every array is
//! bounded by the prompt's block count before it is copied.

use super::{MAX_FIELD_BYTES, Plan, TransferSide};
use crate::engine::http::openai::{EngineApiError, TransferFields};
use kv_events::disaggregation::{TransferProtocol, WorkerRole};
use serde_json::{Map, Value};

/// Largest `bootstrap_room`: SGLang draws rooms in 0..2^63.
const MAX_ROOM: u64 = (1 << 63) - 1;

fn bad(message: impl Into<String>) -> EngineApiError {
    EngineApiError::bad_request(message)
}

/// The plan for a request with `fields`, streamed or not, whose prompt spans
/// `prompt_blocks` blocks (the last may be partial).
///
/// # Errors
/// 400 naming the field: see the module docs of `transfer`.
pub(in crate::engine::http) fn plan(
    side: &TransferSide,
    fields: &TransferFields,
    stream: bool,
    prompt_blocks: u64,
) -> Result<Plan, EngineApiError> {
    let Some(protocol) = side.placement.kv_transfer.map(|t| t.protocol) else {
        return Ok(Plan::Local);
    };
    let vllm = fields.kv_transfer_params.as_ref();
    let sglang = fields.bootstrap_host.is_some()
        || fields.bootstrap_port.is_some()
        || fields.bootstrap_room.is_some();
    match protocol {
        TransferProtocol::Vllm => {
            if sglang {
                return Err(bad(
                    "this engine transfers kv with vllm's kv_transfer_params, not sglang's \
                     bootstrap_host, bootstrap_port and bootstrap_room",
                ));
            }
            vllm.map_or(Ok(Plan::Local), |params| {
                vllm_plan(side.placement.role, params, stream, prompt_blocks)
            })
        }
        TransferProtocol::Sglang => {
            if vllm.is_some() {
                return Err(bad(
                    "this engine transfers kv with sglang's bootstrap_host, bootstrap_port \
                     and bootstrap_room, not vllm's kv_transfer_params",
                ));
            }
            if sglang {
                sglang_plan(side, fields)
            } else {
                Ok(Plan::Local)
            }
        }
    }
}

/// vLLM's `kv_transfer_params`, every known field type-checked whatever the role.
fn vllm_plan(
    role: WorkerRole,
    params: &Value,
    stream: bool,
    prompt_blocks: u64,
) -> Result<Plan, EngineApiError> {
    let map = params
        .as_object()
        .ok_or_else(|| bad("kv_transfer_params must be a json object"))?;
    let remote_decode = flag(map, "do_remote_decode")?;
    let remote_prefill = flag(map, "do_remote_prefill")?;
    let engine_id = text(map, "remote_engine_id")?;
    let host = text(map, "remote_host")?;
    let port = port(map.get("remote_port"), "kv_transfer_params.remote_port")?;
    let block_ids = ids(map, "remote_block_ids", prompt_blocks)?;
    if let Some(tp) = map.get("tp_size").filter(|v| !v.is_null())
        && tp
            .as_u64()
            .is_none_or(|n| n == 0 || n > u64::from(u16::MAX))
    {
        return Err(bad("kv_transfer_params.tp_size must be a positive integer"));
    }
    match (role, remote_decode, remote_prefill) {
        (_, true, true) => Err(bad(
            "kv_transfer_params cannot set both do_remote_decode and do_remote_prefill",
        )),
        (WorkerRole::Prefill, true, false) if stream => Err(bad(
            "a prefill for a remote decode is answered as one json carrying its \
             kv_transfer_params: send \"stream\": false",
        )),
        (WorkerRole::Prefill, true, false) => Ok(Plan::RemoteDecode),
        (WorkerRole::Prefill, false, true) => Err(bad(
            "this is a prefill engine: it does not load a prompt's kv from another \
             (kv_transfer_params.do_remote_prefill)",
        )),
        (WorkerRole::Decode, true, false) => Err(bad(
            "this is a decode engine: it does not prefill for another \
             (kv_transfer_params.do_remote_decode)",
        )),
        (WorkerRole::Decode, false, true) => {
            let missing = |field: &str| {
                bad(format!(
                    "kv_transfer_params.{field} is required with do_remote_prefill"
                ))
            };
            engine_id.ok_or_else(|| missing("remote_engine_id"))?;
            host.ok_or_else(|| missing("remote_host"))?;
            port.ok_or_else(|| missing("remote_port"))?;
            let block_ids = block_ids.ok_or_else(|| missing("remote_block_ids"))?;
            if block_ids.len() as u64 != prompt_blocks {
                return Err(bad(format!(
                    "kv_transfer_params.remote_block_ids names {} blocks but the prompt \
                     has {prompt_blocks}: these are another prompt's parameters",
                    block_ids.len()
                )));
            }
            Ok(Plan::RemotePrefill { block_ids })
        }
        _ => Ok(Plan::Local),
    }
}

/// SGLang's three bootstrap fields, all required once one is given.
fn sglang_plan(side: &TransferSide, fields: &TransferFields) -> Result<Plan, EngineApiError> {
    let missing = |field: &str| {
        bad(format!(
            "{field} is required with the other bootstrap fields \
             (bootstrap_host, bootstrap_port, bootstrap_room)"
        ))
    };
    let host = match fields.bootstrap_host.as_ref() {
        None => return Err(missing("bootstrap_host")),
        Some(v) => host(v)?,
    };
    let port = port(fields.bootstrap_port.as_ref(), "bootstrap_port")?
        .ok_or_else(|| missing("bootstrap_port"))?;
    let room = match fields.bootstrap_room.as_ref() {
        None => return Err(missing("bootstrap_room")),
        Some(v) => v
            .as_u64()
            .filter(|r| *r <= MAX_ROOM)
            .ok_or_else(|| bad("bootstrap_room must be an integer from 0 to 2^63 - 1"))?,
    };
    let own_port = side.placement.kv_transfer.and_then(|t| t.bootstrap_port);
    match side.placement.role {
        WorkerRole::Prefill if own_port != Some(port) => Err(bad(format!(
            "bootstrap_port {port} is not this prefill engine's bootstrap port ({})",
            own_port.map_or("none".to_owned(), |p| p.to_string())
        ))),
        WorkerRole::Prefill => Ok(Plan::BootstrapPrefill { room }),
        WorkerRole::Decode => Ok(Plan::BootstrapDecode { host, port, room }),
        WorkerRole::Both => Ok(Plan::Local),
    }
}

/// A boolean field: absent or null is false.
fn flag(map: &Map<String, Value>, key: &str) -> Result<bool, EngineApiError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!(
            "kv_transfer_params.{key} must be true, false or null"
        ))),
    }
}

/// A string field of at most [`MAX_FIELD_BYTES`]; absent or null is `None`.
fn text(map: &Map<String, Value>, key: &str) -> Result<Option<String>, EngineApiError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.len() <= MAX_FIELD_BYTES => Ok(Some(s.clone())),
        Some(_) => Err(bad(format!(
            "kv_transfer_params.{key} must be a string of at most {MAX_FIELD_BYTES} bytes"
        ))),
    }
}

/// A port number field `name`; absent or null is `None`.
fn port(value: Option<&Value>, name: &str) -> Result<Option<u16>, EngineApiError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p > 0)
            .map(Some)
            .ok_or_else(|| bad(format!("{name} must be a port number from 1 to 65535"))),
    }
}

/// An array of block ids of at most `max` entries; absent or null is `None`.
fn ids(map: &Map<String, Value>, key: &str, max: u64) -> Result<Option<Vec<u64>>, EngineApiError> {
    let shape = || {
        bad(format!(
            "kv_transfer_params.{key} must be an array of at most {max} non-negative \
             integers (the prompt's blocks)"
        ))
    };
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) if items.len() as u64 <= max => items
            .iter()
            .map(|v| v.as_u64().ok_or_else(shape))
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(_) => Err(shape()),
    }
}

/// `bootstrap_host`: a host name or IP literal (letters, digits, `.`, `-`, `:`,
/// brackets), nothing a URL could read as a path or credentials.
fn host(value: &Value) -> Result<String, EngineApiError> {
    let valid = |h: &str| {
        !h.is_empty()
            && h.len() <= MAX_FIELD_BYTES
            && h.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'))
    };
    match value.as_str() {
        Some(h) if valid(h) => Ok(h.to_owned()),
        _ => Err(bad(
            "bootstrap_host must be a host name or ip address (the prefill engine's host)",
        )),
    }
}
