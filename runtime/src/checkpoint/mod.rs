//! Checkpointing: asynchronous barrier snapshots (Chandy-Lamport as Flink does it).
//!
//! The coordinator (module `coordinator`) injects barrier `n` by raising `requested` to `n`;
//! every source head sees it at its next step, records its position and sends
//! `Event::Barrier` down its chain. Exchange writers put the barrier into every output ring;
//! exchange readers align it (or let it pass, at least once); every stateful operator
//! snapshots when the barrier reaches it and reports a `Part` to its shard's
//! `ShardCheckpoint`. When every participant of a shard reported (the asynchronous parts
//! included), the shard acknowledges `n` to the coordinator, which writes the checkpoint's
//! metadata durably and only then announces it complete.

pub mod config;
pub(crate) mod coordinator;
pub mod layout;
pub(crate) mod restore;
pub(crate) mod shard;
pub(crate) mod snapshot;
pub(crate) mod store;

pub use config::{CheckpointConfig, CheckpointMode, ConfigError, RestartStrategy};
pub use coordinator::{CheckpointMetrics, CheckpointStats};
pub use layout::{layout, CheckpointLayout, PartLayout};

/// Whether operators with several inputs hold back inputs that delivered a barrier until the
/// others did (exactly once), or only wait for the last barrier (at least once).
/// The options the engine opens checkpoint storage with: the defaults, and segment files
/// that a checkpoint holds raw are checked block by block when their whole-file CRC fails,
/// so that the error names the damaged block's offset instead of offset 0.
pub fn storage_options() -> weir_io::StorageOptions {
    weir_io::StorageOptions {
        raw_diagnose: Some(weir_state::diagnose_segment),
        ..weir_io::StorageOptions::default()
    }
}

pub(crate) fn aligns(ctx: &crate::graph::BuildCtx) -> bool {
    ctx.checkpoint
        .as_ref()
        .is_none_or(|c| c.borrow().shared.mode() == CheckpointMode::ExactlyOnce)
}

/// With unaligned checkpoints enabled (exactly once), how long an exchange input aligns a
/// barrier before it turns unaligned (zero: at once).
pub(crate) fn unaligned_after(ctx: &crate::graph::BuildCtx) -> Option<std::time::Duration> {
    let c = ctx.checkpoint.as_ref()?;
    let c = c.borrow();
    let cfg = &c.shared.config;
    (cfg.unaligned && cfg.mode == CheckpointMode::ExactlyOnce).then_some(cfg.aligned_timeout)
}

/// What an exchange input's part of an unaligned checkpoint holds: per input channel, the
/// logical file with the frames the barrier overtook.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Default)]
pub(crate) struct ChannelPart {
    pub inputs: Vec<(u32, snapshot::LogicalRefData)>,
}
