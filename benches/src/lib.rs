//! weir's benchmark suites. Each suite returns [`BenchResult`] rows; the `weir-bench` binary
//! prints them as a table or as one JSON object per line.
//!
//! Every figure is reported per wall second and per CPU second of the threads doing the work
//! (this machine is shared and noisy), beside a baseline measured in the same run.

pub mod checkpoint;
pub mod nexmark;
pub mod report;
pub mod ring;
pub mod runtime;
pub mod state;

pub use report::{process_cpu_ns, thread_cpu_ns, BenchResult, Opts};
