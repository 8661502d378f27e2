//! `dynamo-linear`: Dynamo's KV router cost (its default `linear` formula), on the index's
//! per-tier overlap.
//!
//! Dynamo's documented rule, in our words (reference: Dynamo KV router docs and its
//! `kv-router` crate's cost function): with the request's prompt in blocks and its overlap
//! with a worker's cache per tier,
//!
//! ```text
//! adjusted = max(prefill_blocks − 1.0·device − 0.75·host − 0.25·disk − 0.5·shared_beyond, 0)
//! cost     = prefill_load_scale · (adjusted + queued_prefill_blocks) + decode_blocks
//! ```
//!
//! where `device` is the leading run of blocks in device memory, `host` the blocks beyond it
//! in host memory, `disk` the blocks beyond both in the worker's own disk tier, and
//! `shared_beyond` the blocks beyond those in the shared pool (Mooncake store / our shared
//! L3); `queued_prefill_blocks` are the prefill blocks the worker already has in flight (the
//! "potential prefill" Dynamo tracks per worker), `decode_blocks` the KV blocks of its running
//! requests. The lowest cost wins (Dynamo samples a softmax when its temperature is above 0;
//! the default 0 is the argmin). Ties: fewest requests, then the lowest index.

/// Dynamo's weights (its defaults).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct DynamoConfig {
    /// Credit per device block (1.0).
    pub device: f64,
    /// Credit per host block (0.75).
    pub host: f64,
    /// Credit per block on the worker's own disk (0.25).
    pub disk: f64,
    /// Credit per block in the shared pool (0.5).
    pub shared: f64,
    /// Weight of the prefill term against the decode term (1.0).
    pub prefill_load_scale: f64,
}

impl Default for DynamoConfig {
    fn default() -> Self {
        Self {
            device: 1.0,
            host: 0.75,
            disk: 0.25,
            shared: 0.5,
            prefill_load_scale: 1.0,
        }
    }
}

/// One worker's overlap with a request, in blocks per tier (each beyond the faster ones).
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct TierBlocks {
    /// Leading blocks in device memory.
    pub device: f64,
    /// Blocks beyond `device` in host memory.
    pub host: f64,
    /// Blocks beyond those on the worker's own disk.
    pub disk: f64,
    /// Blocks beyond those in the shared pool.
    pub shared: f64,
}

impl DynamoConfig {
    /// The cost of a request of `prefill_blocks` on a worker with `overlap`, `queued_prefill`
    /// prefill blocks in flight and `decode_blocks` KV blocks running.
    pub fn cost(
        &self,
        prefill_blocks: f64,
        overlap: &TierBlocks,
        queued_prefill: f64,
        decode_blocks: f64,
    ) -> f64 {
        let credit = self.device * overlap.device
            + self.host * overlap.host
            + self.disk * overlap.disk
            + self.shared * overlap.shared;
        let adjusted = (prefill_blocks - credit).max(0.0);
        self.prefill_load_scale * (adjusted + queued_prefill) + decode_blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worked example: a 10-block prompt; worker A holds 4 blocks on device and 2 more on
    /// host (credit 4 + 1.5), worker B 8 blocks in the shared pool only (credit 4). A: 10 −
    /// 5.5 = 4.5 + 20 decode blocks = 24.5; B: 10 − 4 = 6 + 10 = 16: B wins on decode load
    /// although A holds the faster tiers.
    #[test]
    fn worked_example_of_the_documented_cost() {
        let d = DynamoConfig::default();
        let a = TierBlocks {
            device: 4.0,
            host: 2.0,
            ..TierBlocks::default()
        };
        let b = TierBlocks {
            shared: 8.0,
            ..TierBlocks::default()
        };
        assert_eq!(d.cost(10.0, &a, 0.0, 20.0), 24.5);
        assert_eq!(d.cost(10.0, &b, 0.0, 10.0), 16.0);
        // Credits never take the prefill term below zero.
        let full = TierBlocks {
            device: 12.0,
            ..TierBlocks::default()
        };
        assert_eq!(d.cost(10.0, &full, 3.0, 1.0), 4.0);
        // A disk block is worth a quarter of a device block.
        let disk = TierBlocks {
            disk: 4.0,
            ..TierBlocks::default()
        };
        assert_eq!(d.cost(10.0, &disk, 0.0, 0.0), 9.0);
    }
}
