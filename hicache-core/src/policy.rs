//! Cache policies as plain serde data with validation: the write policy (when device pages are
//! copied to the host tier), the prefetch policy (when an L3 prefetch may stop) and the
//! thresholds that gate load-back and prefetch. Thresholds and timeouts default to SGLang's
//! values; the two policy enums default to their mildest variant, and
//! `HiCacheConfig` sets SGLang's server defaults (`write_through`, `timeout`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};

/// When device (L1) pages are backed up to the host (L2) tier.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WritePolicy {
    /// Every new node is written to host at once (write-through threshold 1).
    WriteThrough,
    /// A node is written to host on its second hit (threshold 2). The default of this enum
    /// (the most conservative for a bare tree); SGLang's server default, and `HiCacheConfig`'s,
    /// is `write_through`.
    #[default]
    WriteThroughSelective,
    /// Nodes are written to host only when evicted from the device.
    WriteBack,
}

impl WritePolicy {
    /// The insert-path hit count at which a node is due for write-through: 1 for
    /// `write_through`, 2 for `write_through_selective`, `None` for `write_back` (which never
    /// writes on hits).
    pub fn write_through_threshold(self) -> Option<u32> {
        match self {
            WritePolicy::WriteThrough => Some(1),
            WritePolicy::WriteThroughSelective => Some(2),
            WritePolicy::WriteBack => None,
        }
    }

    /// Whether host residency must stay prefix-closed (a node is backed up only after its
    /// parent): true for both write-through modes.
    pub fn host_prefix_closed(self) -> bool {
        !matches!(self, WritePolicy::WriteBack)
    }

    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            WritePolicy::WriteThrough => "write_through",
            WritePolicy::WriteThroughSelective => "write_through_selective",
            WritePolicy::WriteBack => "write_back",
        }
    }
}

impl std::str::FromStr for WritePolicy {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "write_through" => Ok(WritePolicy::WriteThrough),
            "write_through_selective" => Ok(WritePolicy::WriteThroughSelective),
            "write_back" => Ok(WritePolicy::WriteBack),
            _ => Err(CoreError::InvalidPolicy {
                field: "write_policy",
                value: s.to_string(),
                reason: "expected write_through, write_through_selective or write_back",
            }),
        }
    }
}

/// When an L3 prefetch may be terminated and its completed part inserted.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefetchPolicy {
    /// Stop whenever the scheduler wants to run the request. The default of this enum;
    /// SGLang's server default, and `HiCacheConfig`'s, is `timeout`.
    #[default]
    BestEffort,
    /// Wait until every hit page has arrived.
    WaitComplete,
    /// Wait until complete or until [`PrefetchConfig::timeout`] has elapsed.
    Timeout,
}

impl PrefetchPolicy {
    /// The configuration spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            PrefetchPolicy::BestEffort => "best_effort",
            PrefetchPolicy::WaitComplete => "wait_complete",
            PrefetchPolicy::Timeout => "timeout",
        }
    }
}

impl std::str::FromStr for PrefetchPolicy {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "best_effort" => Ok(PrefetchPolicy::BestEffort),
            "wait_complete" => Ok(PrefetchPolicy::WaitComplete),
            "timeout" => Ok(PrefetchPolicy::Timeout),
            _ => Err(CoreError::InvalidPolicy {
                field: "prefetch_policy",
                value: s.to_string(),
                reason: "expected best_effort, wait_complete or timeout",
            }),
        }
    }
}

/// Prefetch knobs. Field names and defaults are SGLang's extra-config keys and values.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefetchConfig {
    /// When a prefetch may stop.
    #[serde(rename = "prefetch_policy")]
    pub policy: PrefetchPolicy,
    /// Minimum number of tokens worth prefetching (SGLang: 256; raised to the page size).
    pub prefetch_threshold: u32,
    /// Seconds every prefetch may take regardless of its size (SGLang: 2.0).
    pub prefetch_timeout_base: f64,
    /// Additional seconds per 1024 tokens (SGLang: 0.1).
    pub prefetch_timeout_per_ki_token: f64,
    /// Upper bound of the timeout in seconds (SGLang: 30).
    pub prefetch_timeout_max: f64,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        Self {
            policy: PrefetchPolicy::BestEffort,
            prefetch_threshold: 256,
            prefetch_timeout_base: 2.0,
            prefetch_timeout_per_ki_token: 0.1,
            prefetch_timeout_max: 30.0,
        }
    }
}

impl PrefetchConfig {
    /// Checks that every number is finite and non-negative and that the base does not exceed
    /// the maximum.
    pub fn validate(&self) -> Result<()> {
        let check = |field: &'static str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(CoreError::InvalidPolicy {
                    field,
                    value: v.to_string(),
                    reason: "must be a finite number of seconds >= 0",
                })
            }
        };
        check("prefetch_timeout_base", self.prefetch_timeout_base)?;
        check(
            "prefetch_timeout_per_ki_token",
            self.prefetch_timeout_per_ki_token,
        )?;
        check("prefetch_timeout_max", self.prefetch_timeout_max)?;
        if self.prefetch_timeout_base > self.prefetch_timeout_max {
            return Err(CoreError::InvalidPolicy {
                field: "prefetch_timeout_base",
                value: self.prefetch_timeout_base.to_string(),
                reason: "must not exceed prefetch_timeout_max",
            });
        }
        Ok(())
    }

    /// `min(max, base + per_ki_token * tokens / 1024)`: how long a prefetch of `tokens` tokens
    /// may run under [`PrefetchPolicy::Timeout`].
    pub fn timeout(&self, tokens: u64) -> Duration {
        let secs = self.prefetch_timeout_base
            + self.prefetch_timeout_per_ki_token * tokens as f64 / 1024.0;
        Duration::from_secs_f64(secs.min(self.prefetch_timeout_max).max(0.0))
    }

    /// The effective threshold in tokens: at least one page.
    pub fn threshold_tokens(&self, page_size: u32) -> u32 {
        self.prefetch_threshold.max(page_size)
    }
}

/// SGLang's load-back threshold: a host hit shorter than this many tokens is not worth loading.
pub const DEFAULT_LOAD_BACK_THRESHOLD_TOKENS: u32 = 10;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_policy_thresholds_and_names() {
        assert_eq!(WritePolicy::WriteThrough.write_through_threshold(), Some(1));
        assert_eq!(
            WritePolicy::WriteThroughSelective.write_through_threshold(),
            Some(2)
        );
        assert_eq!(WritePolicy::WriteBack.write_through_threshold(), None);
        for p in [
            WritePolicy::WriteThrough,
            WritePolicy::WriteThroughSelective,
            WritePolicy::WriteBack,
        ] {
            assert_eq!(p.as_str().parse::<WritePolicy>().unwrap(), p);
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(json, format!("\"{}\"", p.as_str()));
        }
        let err = "write_sometimes".parse::<WritePolicy>().unwrap_err();
        assert!(err.to_string().contains("write_policy"));
    }

    #[test]
    fn prefetch_timeout_formula_uses_sglang_defaults() {
        let c = PrefetchConfig::default();
        c.validate().unwrap();
        assert_eq!(c.timeout(0), Duration::from_secs_f64(2.0));
        assert_eq!(c.timeout(10240), Duration::from_secs_f64(3.0));
        // 2 + 0.1 * 1e6/1024 = 99.6 s, capped at 30.
        assert_eq!(c.timeout(1_000_000), Duration::from_secs(30));
        assert_eq!(c.threshold_tokens(64), 256);
        assert_eq!(c.threshold_tokens(512), 512);
    }

    #[test]
    fn prefetch_config_rejects_bad_values_and_unknown_fields() {
        let bad = PrefetchConfig {
            prefetch_timeout_base: -1.0,
            ..Default::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(CoreError::InvalidPolicy {
                field: "prefetch_timeout_base",
                ..
            })
        ));
        let nan = PrefetchConfig {
            prefetch_timeout_max: f64::NAN,
            ..Default::default()
        };
        assert!(nan.validate().is_err());
        let inverted = PrefetchConfig {
            prefetch_timeout_base: 40.0,
            ..Default::default()
        };
        assert!(inverted.validate().is_err());
        let parsed: PrefetchConfig =
            serde_json::from_str(r#"{"prefetch_policy": "timeout", "prefetch_threshold": 128}"#)
                .unwrap();
        assert_eq!(parsed.policy, PrefetchPolicy::Timeout);
        assert_eq!(parsed.prefetch_threshold, 128);
        assert_eq!(parsed.prefetch_timeout_max, 30.0);
        assert!(serde_json::from_str::<PrefetchConfig>(r#"{"prefetch_treshold": 1}"#).is_err());
        assert!(serde_json::from_str::<PrefetchConfig>(r#"{"prefetch_policy": "eager"}"#).is_err());
    }
}
