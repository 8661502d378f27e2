//! [`Budget`]: the one deadline of one call.
//!
//! Invariant: everything a call does runs under its budget — connecting, every command and
//! reply, redirections (`MOVED`/`ASK`), slot-map refreshes against the known nodes and the
//! seeds, reconnects, the pauses between retries, each `SCAN` round of `clear` and the
//! pipelines it issues. Nothing a call awaits has a timeout of its own that could outlast the
//! budget: every await on the network goes through [`Budget::run`] (or `timeout_at` on
//! [`Budget::end`]), so a call returns at most a scheduling delay after its budget is spent
//! (plus the `WAIT` timeout a write pipeline carries, which is the same length, see
//! [`exec`](crate::exec)). When it is spent the call's error says what was pending.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::RedisError;

/// The deadline of one call (`timeout_ms` from its start) and what the call is.
#[derive(Clone, Debug)]
pub struct Budget {
    op: &'static str,
    end: Instant,
    total: Duration,
}

impl Budget {
    /// A budget of `total` for the call `op` (`batch_get`, `clear`, `open`, …), starting now.
    pub fn new(op: &'static str, total: Duration) -> Self {
        Self {
            op,
            end: Instant::now() + total,
            total,
        }
    }

    /// The call this budget belongs to.
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// When the budget is spent.
    pub fn end(&self) -> Instant {
        self.end
    }

    /// The whole budget, in milliseconds.
    pub fn total_ms(&self) -> u128 {
        self.total.as_millis()
    }

    /// Whether the budget is spent.
    pub fn spent(&self) -> bool {
        Instant::now() >= self.end
    }

    /// The timeout error of this call: `doing` is what was pending ("SCAN round 37 on node
    /// 127.0.0.1:7001").
    pub fn timeout(&self, doing: impl Into<String>) -> RedisError {
        RedisError::Timeout {
            op: self.op,
            doing: doing.into(),
            budget_ms: self.total_ms(),
        }
    }

    /// Runs `fut` until the budget is spent; then the timeout error naming `doing`.
    pub async fn run<T>(
        &self,
        doing: impl FnOnce() -> String,
        fut: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, RedisError> {
        match tokio::time::timeout_at(self.end, fut).await {
            Ok(r) => r,
            Err(_) => Err(self.timeout(doing())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_spent_budget_names_what_was_pending() {
        let b = Budget::new("clear", Duration::from_millis(20));
        let e = b
            .run(
                || "SCAN round 3 on node 127.0.0.1:7001".into(),
                std::future::pending::<Result<(), RedisError>>(),
            )
            .await
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "clear: SCAN round 3 on node 127.0.0.1:7001 not answered within the 20 ms budget"
        );
        assert!(b.spent());
    }
}
