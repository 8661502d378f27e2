//! What an instance registers: where its KV events come from and what it holds.
//!
//! One registration is one stream: one dp rank of one engine instance, with its own PUB
//! endpoint (SGLang and vLLM offset the port by the rank). Its id, the key of `/query`'s
//! `instances`, is the instance's name, or `NAME/dpR` when it registered a `dp_rank`.

use crate::decode::WireFormat;
use serde::{Deserialize, Serialize};

/// Longest instance, model or store name accepted.
pub const MAX_NAME_LEN: usize = 256;
/// Largest page size accepted (tokens).
pub const MAX_PAGE_SIZE: u32 = 1 << 16;

/// `POST /register`'s body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registration {
    /// The instance's name (the routing target).
    pub instance: String,
    /// Its KV-event PUB endpoint, `tcp://HOST:PORT`.
    pub endpoint: String,
    /// Its replay ROUTER endpoint, if it serves one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_endpoint: Option<String>,
    /// The topic it publishes under (default: every topic, as SGLang's default `""`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    /// Its event format.
    pub format: WireFormat,
    /// The model it serves: one index per model.
    pub model: String,
    /// Tokens per page (every instance of a model must agree).
    pub page_size: u32,
    /// Its data-parallel rank, when an engine publishes one stream per rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
    /// The shared L3 store it writes and reads (an id such as a Redis Cluster's name); none:
    /// its L3 is its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub l3_store: Option<String>,
    /// KV tokens its device memory holds (SGLang's `max_total_num_tokens`, vLLM's GPU blocks
    /// × block size): lets the `hicache` routing policy see a request that would wait for
    /// memory there. None: unknown, no memory term.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_capacity_tokens: Option<u64>,
    /// Its L3 prefetch threshold in tokens (SGLang's `prefetch_threshold` of the storage
    /// extra-config, 256 by default; ours the same): an L3 hit shorter than this past what
    /// the instance holds in L1 and L2 is never fetched, so the router credits none of it.
    /// None: every L3 hit is credited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub l3_prefetch_threshold_tokens: Option<u64>,
}

/// A registration that cannot be served, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("registration field `{field}`: {problem}")]
pub struct RegistrationError {
    /// The field.
    pub field: &'static str,
    /// What is wrong.
    pub problem: String,
}

fn name_ok(field: &'static str, s: &str) -> Result<(), RegistrationError> {
    if s.is_empty() || s.len() > MAX_NAME_LEN || s.chars().any(char::is_control) {
        return Err(RegistrationError {
            field,
            problem: format!("must be 1 to {MAX_NAME_LEN} printable characters"),
        });
    }
    Ok(())
}

fn endpoint_ok(field: &'static str, s: &str) -> Result<(), RegistrationError> {
    let rest = s.strip_prefix("tcp://").ok_or_else(|| RegistrationError {
        field,
        problem: format!("{s:?} is not a tcp://HOST:PORT endpoint"),
    })?;
    let port = rest
        .rsplit_once(':')
        .and_then(|(h, p)| (!h.is_empty()).then(|| p.parse::<u16>().ok()).flatten());
    match port {
        Some(p) if p > 0 => Ok(()),
        _ => Err(RegistrationError {
            field,
            problem: format!("{s:?} has no host and port"),
        }),
    }
}

impl Registration {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), RegistrationError> {
        name_ok("instance", &self.instance)?;
        if self.instance.contains('/') {
            return Err(RegistrationError {
                field: "instance",
                problem: "must not contain '/' (ids of dp ranks are NAME/dpR)".into(),
            });
        }
        name_ok("model", &self.model)?;
        endpoint_ok("endpoint", &self.endpoint)?;
        if let Some(r) = &self.replay_endpoint {
            endpoint_ok("replay_endpoint", r)?;
        }
        if let Some(s) = &self.l3_store {
            name_ok("l3_store", s)?;
        }
        if self.kv_capacity_tokens == Some(0) {
            return Err(RegistrationError {
                field: "kv_capacity_tokens",
                problem: "must be at least 1 when given".into(),
            });
        }
        if let Some(t) = &self.topic
            && t.len() > MAX_NAME_LEN
        {
            return Err(RegistrationError {
                field: "topic",
                problem: format!("longer than {MAX_NAME_LEN} bytes"),
            });
        }
        if self.page_size == 0 || self.page_size > MAX_PAGE_SIZE {
            return Err(RegistrationError {
                field: "page_size",
                problem: format!("must be 1 to {MAX_PAGE_SIZE}"),
            });
        }
        Ok(())
    }

    /// The stream's id: the instance's name, or `NAME/dpR` with a dp rank.
    pub fn id(&self) -> String {
        match self.dp_rank {
            None => self.instance.clone(),
            Some(r) => format!("{}/dp{r}", self.instance),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg() -> Registration {
        serde_json::from_str(
            r#"{"instance": "a", "endpoint": "tcp://127.0.0.1:5557", "format": "sglang",
                "model": "m", "page_size": 16}"#,
        )
        .unwrap()
    }

    #[test]
    fn registrations_are_checked_field_by_field() {
        assert!(reg().validate().is_ok());
        assert_eq!(reg().id(), "a");
        let mut r = reg();
        r.dp_rank = Some(2);
        assert_eq!(r.id(), "a/dp2");
        r.endpoint = "ipc:///x".into();
        assert_eq!(r.validate().unwrap_err().field, "endpoint");
        let mut r = reg();
        r.page_size = 0;
        assert_eq!(r.validate().unwrap_err().field, "page_size");
        let mut r = reg();
        r.instance = "a/b".into();
        assert_eq!(r.validate().unwrap_err().field, "instance");
        let mut r = reg();
        r.kv_capacity_tokens = Some(0);
        assert_eq!(r.validate().unwrap_err().field, "kv_capacity_tokens");
        r.kv_capacity_tokens = Some(8192);
        assert!(r.validate().is_ok());
        let err = serde_json::from_str::<Registration>(
            r#"{"instance": "a", "endpoint": "tcp://h:1", "format": "trt", "model": "m", "page_size": 1}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown variant"), "{err}");
    }
}
