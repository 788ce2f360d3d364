//! The output contract of `weir-bench --json`: one JSON object per line, each with `bench`,
//! `per_wall_sec`, `per_cpu_sec`, `baseline`, `baseline_per_cpu_sec` and `ratio`, and the
//! latency fields `p50_ns`, `p99_ns`, `p999_ns` together where a row has latencies. Run on
//! every suite in `--quick` mode (about 20 s), so that a row added or changed later keeps it.

use std::collections::HashSet;
use std::process::Command;

use serde_json::Value;

#[test]
fn every_row_of_every_suite_keeps_the_json_contract() {
    let out = Command::new(env!("CARGO_BIN_EXE_weir-bench"))
        .args(["all", "--quick", "--json"])
        .output()
        .expect("run weir-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status);
    let stdout = String::from_utf8(out.stdout).expect("UTF-8 output");
    let mut names = HashSet::new();
    let mut latency_rows = 0;
    let mut cpu_split_checked = false;
    for (i, line) in stdout.lines().enumerate() {
        let row: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("line {}: not JSON ({e}): {line}", i + 1));
        let obj = row
            .as_object()
            .unwrap_or_else(|| panic!("line {}: not an object: {line}", i + 1));
        let bench = obj
            .get("bench")
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("line {}: no `bench` string", i + 1));
        assert!(names.insert(bench.to_owned()), "`{bench}` twice");
        assert!(
            obj.get("baseline").is_some_and(Value::is_string),
            "`{bench}`: `baseline` is not a string"
        );
        for k in [
            "per_wall_sec",
            "per_cpu_sec",
            "baseline_per_cpu_sec",
            "ratio",
        ] {
            // A figure that could not be computed is null, never a missing key or NaN text.
            let v = obj.get(k).unwrap_or_else(|| panic!("`{bench}`: no `{k}`"));
            assert!(v.is_number() || v.is_null(), "`{bench}`: `{k}` is {v}");
        }
        for (k, v) in obj {
            assert!(
                v.is_number() || v.is_null() || k == "bench" || k == "baseline",
                "`{bench}`: `{k}` is {v}"
            );
        }
        if bench == "state_random_updates" {
            // The maintenance thread's CPU split by job kind: flushes ran (the quick run
            // fills its memtable many times over), and the parts fit in the whole.
            let f = |k: &str| {
                obj.get(k)
                    .and_then(Value::as_f64)
                    .unwrap_or_else(|| panic!("`{bench}`: no `{k}`"))
            };
            let (all, flush, compaction) = (
                f("maintenance_cpu_s"),
                f("flush_cpu_s"),
                f("compaction_cpu_s"),
            );
            assert!(flush > 0.0 && compaction >= 0.0, "{flush} {compaction}");
            assert!(
                flush + compaction <= all * 1.001 + 1e-6,
                "{flush} + {compaction} > {all}"
            );
            cpu_split_checked = true;
        }
        let lat: Vec<Option<u64>> = ["p50_ns", "p99_ns", "p999_ns"]
            .iter()
            .map(|k| obj.get(*k).and_then(Value::as_u64))
            .collect();
        if lat.iter().any(Option::is_some) {
            latency_rows += 1;
            let [p50, p99, p999] = [lat[0], lat[1], lat[2]].map(|v| {
                v.unwrap_or_else(|| panic!("`{bench}`: p50_ns, p99_ns and p999_ns go together"))
            });
            assert!(p50 <= p99 && p99 <= p999, "`{bench}`: {p50} {p99} {p999}");
            if let Some(max) = obj.get("max_ns").and_then(Value::as_u64) {
                assert!(p999 <= max, "`{bench}`: p999 {p999} > max {max}");
            }
        }
    }
    // The suites' rows: runtime, state, checkpoint and Nexmark, with latencies where they
    // apply (the latency row, the snapshot's synchronous part, checkpoint durations).
    for prefix in [
        "ring",
        "chain",
        "keyed_count",
        "latency",
        "state_",
        "checkpoint_",
        "nexmark_",
    ] {
        assert!(
            names.iter().any(|n| n.starts_with(prefix)),
            "no `{prefix}` row in {names:?}"
        );
    }
    assert!(latency_rows >= 5, "{latency_rows} rows with latencies");
    assert!(cpu_split_checked, "no `state_random_updates` row");
}

/// The rows `weir-bench SUITE --quick --json --only ONLY` printed.
fn rows_of(suite: &str, only: &str) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_weir-bench"))
        .args([suite, "--quick", "--json", "--only", only])
        .output()
        .expect("run weir-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status);
    String::from_utf8(out.stdout)
        .expect("UTF-8 output")
        .lines()
        .map(|l| {
            let row: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            row["bench"].as_str().expect("bench").to_owned()
        })
        .collect()
}

#[test]
fn only_selects_rows_by_their_full_name_or_a_part_of_it() {
    // A full row name, in the suites whose sections are named by a prefix of their rows
    // (the checkpoint suite's overhead section) or not at all (the state suite's).
    assert_eq!(
        rows_of("checkpoint", "checkpoint_overhead_keyed_100ms"),
        ["checkpoint_overhead_keyed_100ms"]
    );
    assert_eq!(
        rows_of("state", "state_segment_write"),
        ["state_segment_write"]
    );
    // A row that needs another section's work (the gets read the updates' store) runs it
    // and prints only itself.
    assert_eq!(
        rows_of("state", "state_point_get_segment"),
        ["state_point_get_segment"]
    );
    // A part of a name selects every row that contains it.
    let mut snap = rows_of("state", "snapshot");
    snap.sort();
    assert_eq!(
        snap,
        ["state_snapshot_sync_part", "state_updates_under_snapshot"]
    );
}

/// `--only` with a text no benchmark of the suite has in its name is a usage error naming it
/// (it printed an empty table, or no JSON, and exited 0), and so is an empty text (it ran the
/// whole suite).
#[test]
fn only_with_a_text_no_benchmark_has_is_a_usage_error() {
    for only in ["no_such_bench", ""] {
        let out = Command::new(env!("CARGO_BIN_EXE_weir-bench"))
            .args(["runtime", "--quick", "--json", "--only", only])
            .output()
            .expect("run weir-bench");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{only:?}: {stderr}");
        assert!(stderr.contains("--only"), "{stderr}");
        assert!(out.stdout.is_empty());
    }
}
