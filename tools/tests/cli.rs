//! The `weir` command's contracts: outputs compared with sequential computations, error lines
//! and exit codes (0 success, 1 job or input failure, 2 usage).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn weir(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .output()
        .expect("weir runs")
}

/// `weir` started with `args`, its standard output and error piped to this process.
fn spawn_weir(args: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("weir runs")
}

/// [`weir`], killed if it has not exited within `secs` (a failure, not a hang of the suite).
fn weir_within(args: &[&str], secs: u64) -> Output {
    let mut child = spawn_weir(args);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > until {
            let _ = child.kill();
            let o = child.wait_with_output().expect("output");
            panic!("weir {args:?} still ran after {secs} s: {}", stderr(&o));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child.wait_with_output().expect("output")
}

/// [`weir`] with its standard output a pipe that the reader closed before reading, as
/// `weir ... | head -0` leaves it.
fn weir_to_a_closed_pipe(args: &[&str]) -> Output {
    let mut child = spawn_weir(args);
    drop(child.stdout.take());
    child.wait_with_output().expect("output")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `weir run keyed-sum` of column `amount` by `user`, with `extra` flags after the output.
fn keyed_sum(input: &Path, format: &str, output: &Path, extra: &[&str]) -> Output {
    let mut args = keyed_sum_args(input, format, output);
    args.extend_from_slice(extra);
    weir(&args)
}

/// The arguments of [`keyed_sum`] before its `extra` flags.
fn keyed_sum_args<'a>(input: &'a Path, format: &'a str, output: &'a Path) -> Vec<&'a str> {
    vec![
        "run",
        "keyed-sum",
        "--input",
        input.to_str().expect("utf8"),
        "--format",
        format,
        "--key",
        "user",
        "--value",
        "amount",
        "--output",
        output.to_str().expect("utf8"),
    ]
}

/// Every line of every part file of `dir`.
fn output_lines(dir: &Path) -> Vec<String> {
    let mut lines = Vec::new();
    for e in std::fs::read_dir(dir).expect("output dir") {
        let p = e.expect("entry").path();
        let name = p
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        if name.starts_with("part-") {
            lines.extend(
                std::fs::read_to_string(&p)
                    .expect("part")
                    .lines()
                    .map(String::from),
            );
        }
    }
    lines
}

fn records(n: u64, keys: u64) -> Vec<(String, i64, i64)> {
    (0..n)
        .map(|i| {
            let r = i.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
            let key = format!("k{}", r % keys);
            let value = (r >> 24) as i64 % 2000 - 1000;
            // Event time mostly increasing with some disorder under 2 s.
            let ts = 1_700_000_000_000 + i as i64 * 7 - (r % 1500) as i64;
            (key, value, ts)
        })
        .collect()
}

fn write_csv(path: &Path, recs: &[(String, i64, i64)]) {
    let mut s = String::from("user,amount,ts\n");
    for (k, v, t) in recs {
        s.push_str(&format!("{k},{v},{t}\n"));
    }
    std::fs::write(path, s).expect("write csv");
}

fn write_jsonl(path: &Path, recs: &[(String, i64, i64)]) {
    let mut s = String::new();
    for (k, v, t) in recs {
        s.push_str(&format!(
            "{{\"user\":\"{k}\",\"amount\":{v},\"ts\":{t},\"other\":[1,2]}}\n"
        ));
    }
    std::fs::write(path, s).expect("write jsonl");
}

/// The running sums per key, in input order, as a sorted multiset of lines per key.
fn running_sums(recs: &[(String, i64, i64)]) -> BTreeMap<String, Vec<i64>> {
    let mut sums: HashMap<&str, i64> = HashMap::new();
    let mut out: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (k, v, _) in recs {
        let s = sums.entry(k).or_default();
        *s += v;
        out.entry(k.clone()).or_default().push(*s);
    }
    out
}

fn parse_sums(lines: &[String]) -> BTreeMap<String, Vec<i64>> {
    let mut out: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for l in lines {
        let (k, s) = l.rsplit_once(',').expect("key,sum");
        out.entry(k.to_string())
            .or_default()
            .push(s.parse().expect("sum"));
    }
    out
}

#[test]
fn keyed_sum_csv_and_jsonl_on_four_shards_match_sequential() {
    let dir = tempfile::tempdir().expect("tmp");
    let recs = records(30_000, 101);
    // A directory of files, read in name order.
    let input = dir.path().join("in");
    std::fs::create_dir(&input).expect("mkdir");
    write_csv(&input.join("a.csv"), &recs[..10_000]);
    write_csv(&input.join("b.csv"), &recs[10_000..]);
    let out = dir.path().join("out");
    let o = keyed_sum(&input, "csv", &out, &["--shards", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Per key, the sums appear in input order within the key's part file.
    assert_eq!(parse_sums(&output_lines(&out)), running_sums(&recs));

    let jl = dir.path().join("in.jsonl");
    write_jsonl(&jl, &recs);
    let out2 = dir.path().join("out2");
    let o = keyed_sum(&jl, "jsonl", &out2, &["--shards", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(parse_sums(&output_lines(&out2)), running_sums(&recs));
}

#[test]
fn window_count_matches_sequential_windows() {
    let dir = tempfile::tempdir().expect("tmp");
    let recs = records(20_000, 13);
    let input = dir.path().join("in.csv");
    write_csv(&input, &recs);
    let out = dir.path().join("out");
    let mut args = window_count_args(&input, &out, "10s");
    args.extend(["--shards".to_owned(), "4".to_owned()]);
    let o = weir(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", stderr(&o));
    let mut got = output_lines(&out);
    got.sort();
    assert_eq!(got, window_counts(&recs, 10_000));
}

/// Timestamps whose 10 s window does not fit in i64 (and `i64::MIN`, the engine's mark of no
/// timestamp) are bad lines named by file and line; skipped, the other lines count as usual.
/// Before, the first wrapped into a far-future window and the job exited 0.
#[test]
fn window_count_timestamps_without_a_representable_window_are_bad_lines() {
    let dir = tempfile::tempdir().expect("tmp");
    let input = dir.path().join("in.csv");
    let near_max = i64::MAX - 3;
    std::fs::write(
        &input,
        format!(
            "user,ts\na,1000\na,-9223372036854775807\nb,{}\nc,{near_max}\nb,2000\n",
            i64::MIN
        ),
    )
    .expect("write");
    let out = dir.path().join("out");
    let args = window_count_args(&input, &out, "10s");
    let o = weir(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("in.csv:3") && e.contains("-9223372036854775807") && e.contains("window"),
        "names file, line and value: {e}"
    );
    let mut args = args;
    args.extend(["--on-error".to_owned(), "skip".to_owned()]);
    let o = weir(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("3 skipped"), "{}", stderr(&o));
    let mut got = output_lines(&out);
    got.sort();
    assert_eq!(got, ["0,a,1", "0,b,1"]);
}

/// `weir run window-count` over the CSV `input` into `output` with `window` tumbling windows.
/// Disorder in [`records`] is under 1.5 s and the bound is 2 s: no record is late, so the
/// counts are exact.
fn window_count_args(input: &Path, output: &Path, window: &str) -> Vec<String> {
    let (input, output) = (
        input.to_str().expect("utf8"),
        output.to_str().expect("utf8"),
    );
    [
        "run",
        "window-count",
        "--input",
        input,
        "--format",
        "csv",
        "--key",
        "user",
        "--timestamp",
        "ts",
        "--window",
        window,
        "--out-of-orderness",
        "2s",
        "--output",
        output,
    ]
    .map(str::to_owned)
    .to_vec()
}

/// The lines `window,key,count` of `window_ms` tumbling windows over `recs`, sorted.
fn window_counts(recs: &[(String, i64, i64)], window_ms: i64) -> Vec<String> {
    let mut counts: BTreeMap<(i64, &str), u64> = BTreeMap::new();
    for (k, _, t) in recs {
        *counts.entry((t - t.rem_euclid(window_ms), k)).or_default() += 1;
    }
    let mut lines: Vec<String> = counts
        .iter()
        .map(|((w, k), n)| format!("{w},{k},{n}"))
        .collect();
    lines.sort();
    lines
}

#[test]
fn malformed_lines_follow_the_error_policy() {
    let dir = tempfile::tempdir().expect("tmp");
    let input = dir.path().join("in.csv");
    std::fs::write(&input, "user,amount\na,1\nb,notanumber\na,2\nc\n").expect("write");
    let out = dir.path().join("out");

    let r = keyed_sum(&input, "csv", &out, &[]);
    assert_eq!(r.status.code(), Some(1));
    let e = stderr(&r);
    assert!(
        e.contains("in.csv:3") && e.contains("notanumber"),
        "names file and line: {e}"
    );
    assert_eq!(
        e.lines().filter(|l| l.starts_with("error:")).count(),
        1,
        "one error line: {e}"
    );

    let r = keyed_sum(&input, "csv", &out, &["--on-error", "skip"]);
    assert!(r.status.success(), "{}", stderr(&r));
    let mut got = output_lines(&out);
    got.sort();
    assert_eq!(got, vec!["a,1", "a,3"]);
    assert!(stderr(&r).contains("2 skipped"), "{}", stderr(&r));

    let dl = dir.path().join("dead/letters.jsonl");
    let r = keyed_sum(
        &input,
        "csv",
        &out,
        &["--on-error", &format!("dead-letter={}", dl.display())],
    );
    assert!(r.status.success(), "{}", stderr(&r));
    let letters = std::fs::read_to_string(&dl).expect("dead letters");
    let rows: Vec<serde_json::Value> = letters
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["line"], 3);
    assert_eq!(rows[0]["raw"], "b,notanumber");
    assert_eq!(rows[1]["line"], 5);
}

/// `weir run keyed-sum` over one CSV text: exit code, stderr, sorted output lines.
fn keyed_sum_csv(text: &str) -> (Option<i32>, String, Vec<String>) {
    let dir = tempfile::tempdir().expect("tmp");
    let input = dir.path().join("in.csv");
    std::fs::write(&input, text).expect("write");
    let out = dir.path().join("out");
    let r = weir(&[
        "run",
        "keyed-sum",
        "--input",
        input.to_str().expect("utf8"),
        "--format",
        "csv",
        "--key",
        "k",
        "--value",
        "v",
        "--output",
        out.to_str().expect("utf8"),
    ]);
    let mut lines = if out.exists() {
        output_lines(&out)
    } else {
        Vec::new()
    };
    lines.sort();
    (r.status.code(), stderr(&r), lines)
}

#[test]
fn sums_past_the_64_bit_range_are_exact_and_values_past_it_are_errors() {
    let max = i64::MAX;
    let (code, e, lines) = keyed_sum_csv(&format!("k,v\na,{max}\na,{max}\nb,{}\nb,-1\n", i64::MIN));
    assert_eq!(code, Some(0), "{e}");
    let twice = 2 * i128::from(max);
    let below = i128::from(i64::MIN) - 1;
    let mut want = vec![
        format!("a,{max}"),
        format!("a,{twice}"),
        format!("b,{}", i64::MIN),
        format!("b,{below}"),
    ];
    want.sort();
    assert_eq!(lines, want, "neither clamped nor wrapped");

    let (code, e, _) = keyed_sum_csv("k,v\na,1\na,99999999999999999999\n");
    assert_eq!(code, Some(1));
    assert!(
        e.contains("in.csv:3") && e.contains("outside the 64-bit integer range"),
        "{e}"
    );
}

/// A key longer than keyed state takes is a bad line named by file and line (skipped under
/// `--on-error skip`); before, the job's shard panicked on it.
#[test]
fn a_key_longer_than_keyed_state_takes_is_a_bad_line() {
    let long = "x".repeat(70_000);
    let (code, e, _) = keyed_sum_csv(&format!("k,v\na,1\n{long},2\nb,3\n"));
    assert_eq!(code, Some(1), "{e}");
    assert!(
        e.contains("in.csv:3") && e.contains("70002 bytes") && !e.contains("panicked"),
        "{e}"
    );
}

#[test]
fn a_csv_header_naming_a_wanted_column_twice_is_an_error() {
    let (code, e, lines) = keyed_sum_csv("k,v,k\na,1,b\n");
    assert_eq!(code, Some(1));
    assert!(
        e.contains("in.csv:1") && e.contains("column `k` is both field 1 and field 3"),
        "{e}"
    );
    assert!(lines.is_empty(), "{lines:?}");
    // A repeated column the job does not read is no ambiguity.
    let (code, e, lines) = keyed_sum_csv("k,x,v,x\na,0,1,0\n");
    assert_eq!(code, Some(0), "{e}");
    assert_eq!(lines, vec!["a,1"]);
}

#[test]
fn errors_name_what_and_where_with_the_right_exit_code() {
    let dir = tempfile::tempdir().expect("tmp");
    let input = dir.path().join("in.csv");
    std::fs::write(&input, "user,amount\na,1\n").expect("write");
    let out = dir.path().join("out");
    let (i, o) = (input.to_str().expect("utf8"), out.to_str().expect("utf8"));

    let r = weir(&[
        "run",
        "keyed-sum",
        "--input",
        i,
        "--format",
        "csv",
        "--key",
        "nope",
        "--value",
        "amount",
        "--output",
        o,
    ]);
    assert_eq!(r.status.code(), Some(1));
    assert!(
        stderr(&r).contains("unknown column `nope`"),
        "{}",
        stderr(&r)
    );

    let missing = dir.path().join("missing.csv");
    let r = weir(&[
        "run",
        "keyed-sum",
        "--input",
        missing.to_str().expect("utf8"),
        "--format",
        "csv",
        "--key",
        "user",
        "--value",
        "amount",
        "--output",
        o,
    ]);
    assert_eq!(r.status.code(), Some(1));
    assert!(stderr(&r).contains("missing.csv"), "{}", stderr(&r));

    let r = keyed_sum(&input, "xml", &out, &[]);
    assert_eq!(
        r.status.code(),
        Some(2),
        "a bad flag value is a usage error"
    );
    let r = weir(&[
        "run",
        "window-count",
        "--input",
        i,
        "--format",
        "csv",
        "--key",
        "user",
        "--timestamp",
        "amount",
        "--window",
        "ten",
        "--output",
        o,
    ]);
    assert_eq!(r.status.code(), Some(2));
    // A zero (or sub-millisecond) window or checkpoint interval is refused, not rounded up.
    for window in ["0s", "500us"] {
        let r = weir(&[
            "run",
            "window-count",
            "--input",
            i,
            "--format",
            "csv",
            "--key",
            "user",
            "--timestamp",
            "amount",
            "--window",
            window,
            "--output",
            o,
        ]);
        assert_eq!(r.status.code(), Some(2), "--window {window}");
        assert!(stderr(&r).contains(window), "{}", stderr(&r));
    }
    let ck = dir.path().join("ck");
    let r = keyed_sum(
        &input,
        "csv",
        &out,
        &[
            "--checkpoint-dir",
            ck.to_str().expect("utf8"),
            "--checkpoint-interval",
            "0ms",
        ],
    );
    assert_eq!(r.status.code(), Some(2));
    assert!(stderr(&r).contains("must be more than 0"), "{}", stderr(&r));
    // No retained checkpoint is a usage error, as `retained = 0` in TOML is a config error
    // (it was taken as 1 without a word).
    let ck_s = ck.to_str().expect("utf8");
    let r = keyed_sum(
        &input,
        "csv",
        &out,
        &["--checkpoint-dir", ck_s, "--retained", "0"],
    );
    assert_eq!(r.status.code(), Some(2), "{}", stderr(&r));
    assert!(stderr(&r).contains("--retained"), "{}", stderr(&r));
    // An output path, or a state directory, that is a file.
    let r = keyed_sum(&input, "csv", &input, &[]);
    assert_eq!(r.status.code(), Some(1));
    assert!(
        stderr(&r).contains("exists and is not a directory"),
        "{}",
        stderr(&r)
    );
    let r = keyed_sum(&input, "csv", &out, &["--state-dir", i]);
    assert_eq!(r.status.code(), Some(1));
    let e = stderr(&r);
    assert!(
        e.contains(&format!("{i}: exists and is not a directory")),
        "{e}"
    );
    let r = weir(&["run", "nope"]);
    assert_eq!(r.status.code(), Some(2));
    assert!(!stderr(&r).contains("panicked"));
}

#[test]
fn a_checkpointed_run_shows_its_checkpoints_on_a_status_line() {
    let dir = tempfile::tempdir().expect("tmp");
    let input = dir.path().join("in.csv");
    let recs = records(1_000_000, 500);
    write_csv(&input, &recs);
    let ck = dir.path().join("ck");
    let out = dir.path().join("out");
    let ck_s = ck.to_str().expect("utf8");
    let r = keyed_sum(
        &input,
        "csv",
        &out,
        &["--checkpoint-dir", ck_s, "--checkpoint-interval", "1ms"],
    );
    assert!(r.status.success(), "{}", stderr(&r));
    let e = stderr(&r);
    // Written where the summary is: standard error, a line each (not a terminal).
    let status = e
        .lines()
        .find(|l| l.starts_with("keyed-sum: ") && l.contains(" records in, checkpoints "))
        .unwrap_or_else(|| panic!("a status line: {e}"));
    assert!(
        status.contains(" failed ") && status.contains(" in progress "),
        "{status}"
    );
    assert_eq!(parse_sums(&committed_lines(&out)), running_sums(&recs));
}

#[test]
fn demo_runs_and_reports_its_summary() {
    let r = weir(&[
        "run", "demo", "--events", "200000", "--shards", "4", "--keys", "1000",
    ]);
    assert!(r.status.success(), "{}", stderr(&r));
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(out.contains("bids generated         200000"), "{out}");
    assert!(out.contains("bids counted in windows 200000"), "{out}");
}

/// Lines of the part files of a transactional sink in commit order: by shard, then sequence
/// number.
fn committed_lines(dir: &Path) -> Vec<String> {
    lines_of(&part_files(dir))
}

/// The part files of a transactional sink in commit order: by shard, then sequence number.
fn part_files(dir: &Path) -> Vec<PathBuf> {
    let mut parts: Vec<(u64, u64, std::path::PathBuf)> = Vec::new();
    for e in std::fs::read_dir(dir).expect("output dir") {
        let p = e.expect("entry").path();
        let name = p
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        if let Some(rest) = name
            .strip_prefix("part-")
            .and_then(|r| r.strip_suffix(".csv"))
        {
            let mut it = rest
                .split('-')
                .map(|x| x.parse::<u64>().expect("part name"));
            let (s, q) = (it.next().expect("shard"), it.next().unwrap_or(0));
            parts.push((s, q, p));
        }
    }
    parts.sort();
    parts.into_iter().map(|(_, _, p)| p).collect()
}

/// The lines of `files`, in order.
fn lines_of(files: &[PathBuf]) -> Vec<String> {
    let mut lines = Vec::new();
    for p in files {
        lines.extend(
            std::fs::read_to_string(p)
                .expect("part")
                .lines()
                .map(String::from),
        );
    }
    lines
}

/// What the checkpointing tests start from: a temporary directory holding `n` records with
/// `keys` keys as `in.csv` or `in.jsonl` (`format`), and where output (`out`) and checkpoints
/// (`ckpt`) go.
struct Inputs {
    dir: tempfile::TempDir,
    recs: Vec<(String, i64, i64)>,
    input: PathBuf,
    out: PathBuf,
    ck: PathBuf,
}

impl Inputs {
    fn new(n: u64, keys: u64, format: &str) -> Inputs {
        let dir = tempfile::tempdir().expect("tmp");
        let recs = records(n, keys);
        let input = dir.path().join(format!("in.{format}"));
        match format {
            "csv" => write_csv(&input, &recs),
            _ => write_jsonl(&input, &recs),
        }
        let (out, ck) = (dir.path().join("out"), dir.path().join("ckpt"));
        Inputs {
            dir,
            recs,
            input,
            out,
            ck,
        }
    }

    /// `weir run keyed-sum` of the (JSONL) input checkpointing into `ck`, which must succeed.
    fn run_checkpointed(&self) {
        let flags = ["--checkpoint-dir", self.ck.to_str().expect("utf8")];
        let r = keyed_sum(&self.input, "jsonl", &self.out, &flags);
        assert!(r.status.success(), "{}", stderr(&r));
    }
}

/// A checkpointed `weir run keyed-sum` (or another job, see [`CheckpointedRun::window_count`])
/// over a fresh CSV of `n` records with `keys` keys, in a temporary directory: exactly once
/// into `out` on `shards` shards, a checkpoint every `interval` in `ck`, continuing from the
/// newest one (`--restore latest`).
struct CheckpointedRun {
    dir: tempfile::TempDir,
    recs: Vec<(String, i64, i64)>,
    out: PathBuf,
    ck: PathBuf,
    args: Vec<String>,
}

impl CheckpointedRun {
    fn new(n: u64, keys: u64, shards: &str, interval: &str) -> CheckpointedRun {
        Self::of_job(n, keys, shards, interval, |input, out| {
            keyed_sum_args(input, "csv", out)
                .into_iter()
                .map(str::to_owned)
                .collect()
        })
    }

    /// `weir run window-count` with `window` tumbling windows ([`window_count_args`]).
    fn window_count(n: u64, keys: u64, shards: &str, interval: &str, window: &str) -> Self {
        Self::of_job(n, keys, shards, interval, |input, out| {
            window_count_args(input, out, window)
        })
    }

    /// The run of the job whose arguments `job(input, output)` gives.
    fn of_job(
        n: u64,
        keys: u64,
        shards: &str,
        interval: &str,
        job: impl FnOnce(&Path, &Path) -> Vec<String>,
    ) -> CheckpointedRun {
        let Inputs {
            dir,
            recs,
            input,
            out,
            ck,
        } = Inputs::new(n, keys, "csv");
        let mut args = job(&input, &out);
        let ck_s = ck.to_str().expect("utf8");
        args.extend(
            [
                "--shards",
                shards,
                "--checkpoint-dir",
                ck_s,
                "--checkpoint-interval",
                interval,
                "--restore",
                "latest",
            ]
            .map(str::to_owned),
        );
        CheckpointedRun {
            dir,
            recs,
            out,
            ck,
            args,
        }
    }

    fn args(&self) -> Vec<&str> {
        self.args.iter().map(String::as_str).collect()
    }

    /// The run of `job`, killed (SIGKILL) once its checkpoint `id` or a later one completed,
    /// or finished before that; it must have left a complete checkpoint.
    fn killed_after(&self, job: &str, id: u64) {
        let job_dir = self.ck.join(job);
        self.killed_when("no checkpoint", || newest_complete_id(&job_dir) >= Some(id));
        assert!(
            has_complete_checkpoint(&job_dir),
            "the run left a checkpoint"
        );
    }

    /// The run, killed (SIGKILL) once `until` holds (checked every millisecond), or finished
    /// before that; `what` names what did not happen within 60 s.
    fn killed_when(&self, what: &str, until: impl Fn() -> bool) {
        let mut child = self.spawn();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !until() && child.try_wait().expect("try_wait").is_none() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// The run started in the background, its output discarded.
    fn spawn(&self) -> std::process::Child {
        Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(&self.args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn")
    }
}

/// Kills `weir run keyed-sum` with SIGKILL again and again, restarting it each time with
/// `--restore latest`, then lets it finish: the committed output holds every running sum
/// exactly once, in input order per key.
#[test]
fn kill_loop_with_restore_latest_commits_every_result_exactly_once() {
    kill_loop(&[]);
}

/// The kill loop with unaligned checkpoints: what a barrier overtook in the exchange rings is
/// restored from the checkpoint's channel state and replayed before new input, so the output
/// is still exact.
#[test]
fn kill_loop_with_unaligned_checkpoints_commits_every_result_exactly_once() {
    kill_loop(&["--unaligned"]);
}

/// The kill loop with unaligned checkpoints that start aligned and turn unaligned after 1 ms.
#[test]
fn kill_loop_with_an_alignment_timeout_commits_every_result_exactly_once() {
    kill_loop(&["--unaligned", "--aligned-timeout", "1ms"]);
}

/// `WEIR_KILL_LOOPS` kills (default 4) of checkpointed keyed-sum runs with `extra` flags. A
/// round kills a run again and again at random moments, each restart continuing from the
/// newest checkpoint, until a run finishes before its kill; a final run then checks the
/// committed output and the checkpoint. Rounds repeat, each on a fresh input, until the kills
/// are done: a finished job has nothing left to kill, and restarts after that test nothing.
fn kill_loop(extra: &[&str]) {
    kill_loop_of(
        "keyed-sum",
        || CheckpointedRun::new(1_200_000, 997, "2", "50ms"),
        extra,
        false,
        |run, mid_run| {
            let got = parse_sums(&committed_lines(&run.out));
            let want = running_sums(&run.recs);
            assert_same_sums(&got, &want, &format!("in order ({mid_run} kills mid-run)"));
        },
    );
}

/// Every key of `want` has exactly its sums in `got`, and `got` no other key.
fn assert_same_sums(
    got: &BTreeMap<String, Vec<i64>>,
    want: &BTreeMap<String, Vec<i64>>,
    how: &str,
) {
    for (k, sums) in want {
        assert_eq!(
            got.get(k),
            Some(sums),
            "key {k}: every running sum exactly once, {how}"
        );
    }
    assert_eq!(got.len(), want.len());
}

/// The kill loop of `weir run window-count` with unaligned checkpoints, 100 ms windows and a
/// 2 s bound on disorder: windows fire as the watermark passes them, the last ones when the
/// input ends, and every window's count is committed exactly once.
#[test]
fn kill_loop_of_window_count_commits_every_window_exactly_once() {
    kill_loop_of(
        "window-count",
        || CheckpointedRun::window_count(1_200_000, 997, "2", "50ms", "100ms"),
        &["--unaligned"],
        false,
        |run, mid_run| {
            let mut got = committed_lines(&run.out);
            got.sort();
            let want = window_counts(&run.recs, 100);
            assert_eq!(got.len(), want.len(), "{mid_run} kills mid-run");
            assert!(
                got == want,
                "every window exactly once ({mid_run} kills mid-run)"
            );
        },
    );
}

/// The unaligned keyed-sum kill loop restarting on 1, 2 or 3 shards in turn: each restore
/// redistributes the key groups and the channel state. Part files are per shard, so a key
/// that moved has its sums in several shards' files, in no order between them: each key's
/// committed sums are compared as a multiset.
#[test]
fn kill_loop_that_changes_the_shard_count_commits_every_result_exactly_once() {
    kill_loop_of(
        "keyed-sum",
        || CheckpointedRun::new(1_200_000, 997, "2", "50ms"),
        &["--unaligned"],
        true,
        |run, mid_run| {
            let sorted = |m: BTreeMap<String, Vec<i64>>| {
                m.into_iter()
                    .map(|(k, mut v)| {
                        v.sort_unstable();
                        (k, v)
                    })
                    .collect::<BTreeMap<_, _>>()
            };
            let got = sorted(parse_sums(&committed_lines(&run.out)));
            let want = sorted(running_sums(&run.recs));
            assert_same_sums(
                &got,
                &want,
                &format!("in any order ({mid_run} kills mid-run)"),
            );
        },
    );
}

/// A checkpointed keyed-sum run (`interval` between checkpoints) over an input with a malformed
/// line after every 997th record, dead-lettered into `dead.jsonl` beside it.
fn run_with_malformed_lines(interval: &str) -> CheckpointedRun {
    let mut run = CheckpointedRun::new(1_200_000, 997, "2", interval);
    let input = run.dir.path().join("in.csv");
    let mut text = String::from("user,amount,ts\n");
    for (i, (k, v, t)) in run.recs.iter().enumerate() {
        text.push_str(&format!("{k},{v},{t}\n"));
        if i % 997 == 996 {
            text.push_str(&format!("{k},not-a-number-{i},{t}\n"));
        }
    }
    std::fs::write(&input, text).expect("input");
    let dead = run.dir.path().join("dead.jsonl");
    run.args.extend([
        "--on-error".to_owned(),
        format!("dead-letter={}", dead.display()),
    ]);
    run
}

/// The line numbers of the malformed lines of [`run_with_malformed_lines`]: the header is line
/// 1, record i is line i + 2 plus the malformed lines before it.
fn malformed_line_numbers(run: &CheckpointedRun) -> Vec<u64> {
    (0..run.recs.len() as u64)
        .filter(|i| i % 997 == 996)
        .map(|i| i + 3 + i / 997)
        .collect()
}

/// The `line` of each dead letter in `lines`, each of which must be a whole JSON object.
fn dead_letter_line_numbers<'a>(lines: impl Iterator<Item = &'a str>, how: &str) -> Vec<u64> {
    lines
        .map(|l| {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l} ({how})"));
            v["line"].as_u64().expect("line")
        })
        .collect()
}

/// Asserts that the dead letters `lines` are the malformed lines of `run`, each once, in
/// order (compared by count and first difference: the lists are 1,203 numbers long).
fn assert_each_malformed_line_once<'a>(
    run: &CheckpointedRun,
    lines: impl Iterator<Item = &'a str>,
    how: &str,
) {
    let numbers = dead_letter_line_numbers(lines, how);
    let want = malformed_line_numbers(run);
    let first_difference = numbers.iter().zip(&want).position(|(a, b)| a != b);
    assert_eq!(
        (numbers.len(), first_difference),
        (want.len(), None),
        "each malformed line once, {how}"
    );
}

/// The kill loop over an input with a malformed line after every 997th record, dead-lettered
/// (`--on-error dead-letter=PATH`): each restart cuts the dead-letter file back to where the
/// restored checkpoint left it, or (a run killed before its first checkpoint) to where the
/// first run found it, so every line is whole and every malformed line is in the file exactly
/// once, and the committed output is every running sum of the good records exactly once.
#[test]
fn kill_loop_with_dead_letters_writes_each_malformed_line_once() {
    kill_loop_of(
        "keyed-sum",
        || run_with_malformed_lines("50ms"),
        &[],
        false,
        |run, mid_run| {
            let got = parse_sums(&committed_lines(&run.out));
            let how = format!("in order ({mid_run} kills mid-run)");
            assert_same_sums(&got, &running_sums(&run.recs), &how);
            let dead = std::fs::read_to_string(run.dir.path().join("dead.jsonl")).expect("dead");
            // Every malformed line once, in order: a restart from a checkpoint cuts the file
            // back to the checkpoint's position, and one from the beginning (a run killed
            // before its first checkpoint) to the start record of the first run.
            assert_each_malformed_line_once(run, dead.lines(), &how);
        },
    );
}

/// A run with dead letters killed before its first checkpoint, restarted with `--restore
/// latest`: the restart starts from the beginning and cuts the dead-letter file back to where
/// the first run found it (the start record in the job's checkpoint directory), so each
/// malformed line is in it once and what was there before the first run stays. A start record
/// that does not decode stops a restart from the beginning (exit 1), naming it and the offset.
#[test]
fn a_restart_from_the_beginning_cuts_the_dead_letters_of_a_run_killed_before_its_first_checkpoint()
{
    // No checkpoint but the final one: every kill lands before the first.
    let run = run_with_malformed_lines("1h");
    let dead = run.dir.path().join("dead.jsonl");
    // Dead letters of an earlier, separate run: they stay.
    let earlier = "{\"earlier\":true}\n";
    std::fs::write(&dead, earlier).expect("earlier dead letters");
    let job_dir = run.ck.join("keyed-sum");
    let record = job_dir.join("dead-letter-start");
    // Killed once dead letters are written, twice: the second run starts from the beginning too.
    for _ in 0..2 {
        run.killed_when("no dead letters", || {
            std::fs::metadata(&dead).map_or(0, |m| m.len()) >= earlier.len() as u64 + 500
        });
        assert!(
            !has_complete_checkpoint(&job_dir),
            "killed before its first checkpoint"
        );
    }
    assert!(record.exists(), "the first run left its start record");
    let text = |dead: &Path| std::fs::read_to_string(dead).expect("dead");
    assert!(
        text(&dead).lines().count() > 2,
        "the killed runs wrote dead letters"
    );
    let o = weir(&run.args());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_same_sums(
        &parse_sums(&committed_lines(&run.out)),
        &running_sums(&run.recs),
        "after two kills before the first checkpoint",
    );
    let got = text(&dead);
    let mut lines = got.lines();
    assert_eq!(
        lines.next(),
        Some(earlier.trim_end()),
        "the earlier run's line stays"
    );
    assert_each_malformed_line_once(&run, lines, "after two kills");
    // A damaged record is refused, naming it and where, by a restart that finds no complete
    // checkpoint (a checkpoint directory that holds the record alone) and so starts from the
    // beginning.
    let mut bad = std::fs::read(&record).expect("record");
    bad[17] ^= 0x10;
    let bare = run.dir.path().join("bare-ck");
    std::fs::create_dir_all(bare.join("keyed-sum")).expect("bare checkpoint dir");
    std::fs::write(bare.join("keyed-sum").join("dead-letter-start"), &bad).expect("damage");
    let mut args = run.args();
    let at = args
        .iter()
        .position(|a| *a == "--checkpoint-dir")
        .expect("flag")
        + 1;
    let bare_arg = bare.to_string_lossy();
    args[at] = &bare_arg;
    let o = weir(&args);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("dead-letter-start") && e.contains("offset") && e.contains("remove it"),
        "names the record and the offset, and what to do: {e}"
    );
}

/// A restore from a checkpoint does not read the dead-letter start record (the checkpoint's
/// source position says where to cut the dead-letter file), so a damaged record does not stop
/// it: killed after its first checkpoint, with its record then damaged, a run restarted with
/// `--restore latest` finishes with exact output and each malformed line dead-lettered once,
/// and leaves the record as it was.
#[test]
fn a_damaged_start_record_does_not_stop_a_restore_from_a_checkpoint() {
    let run = run_with_malformed_lines("100ms");
    let dead = run.dir.path().join("dead.jsonl");
    run.killed_after("keyed-sum", 1);
    let record = run.ck.join("keyed-sum").join("dead-letter-start");
    let mut bad = std::fs::read(&record).expect("the run left its start record");
    bad[17] ^= 0x10;
    std::fs::write(&record, &bad).expect("damage");
    let o = weir(&run.args());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_same_sums(
        &parse_sums(&committed_lines(&run.out)),
        &running_sums(&run.recs),
        "restored past a damaged start record",
    );
    let got = std::fs::read_to_string(&dead).expect("dead");
    assert_each_malformed_line_once(&run, got.lines(), "after the restore");
    assert_eq!(
        std::fs::read(&record).expect("record"),
        bad,
        "left as it was"
    );
}

/// `WEIR_KILL_LOOPS` kills (default 4) of checkpointed runs of `job` (made by `make`) with
/// `extra` flags, with `rescale` each run on 1, 2 or 3 shards in turn; `check(run, kills
/// mid-run)` checks the committed output of each round (see [`kill_loop`]). A round's kills
/// alternate between a random moment and just after the run completed a new checkpoint.
fn kill_loop_of(
    job: &str,
    make: impl Fn() -> CheckpointedRun,
    extra: &[&str],
    rescale: bool,
    check: impl Fn(&CheckpointedRun, u32),
) {
    let kills: u32 = std::env::var("WEIR_KILL_LOOPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    // A round's first kill comes early (40-120 ms), so that it lands mid-run on a machine
    // faster than this one too; later ones anywhere in 60-300 ms.
    let mut next_delay_ms = |first: bool| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        if first {
            40 + rng % 80
        } else {
            60 + rng % 240
        }
    };
    let mut killed = 0u32;
    // Channel-state parts in the checkpoints the killed runs left: `--unaligned` must take
    // checkpoints unaligned (a CLI that dropped the flag passed every exactly-once check).
    let (mut channel_parts, mut inspected) = (0usize, 0u32);
    while killed < kills {
        // About 0.7 s of work on 2 cores here, so that most kills land mid-run.
        let mut run = make();
        run.args.extend(extra.iter().map(|s| s.to_string()));
        let mut mid_run = 0u32;
        let shards_at = run
            .args
            .iter()
            .position(|a| a == "--shards")
            .expect("--shards")
            + 1;
        while killed < kills {
            if rescale {
                run.args[shards_at] = (1 + killed % 3).to_string();
            }
            // Every second kill of a round waits for a checkpoint newer than the ones the run
            // started with, so that restarts restore checkpoints however slow the machine is (on a
            // loaded one, timed kills alone could all land before the first checkpoint).
            let before = newest_complete_id(&run.ck.join(job));
            let mut child = run.spawn();
            if mid_run % 2 == 1 {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
                while newest_complete_id(&run.ck.join(job)) <= before
                    && child.try_wait().expect("try_wait").is_none()
                    && std::time::Instant::now() < deadline
                {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
            }
            let delay = next_delay_ms(mid_run == 0);
            let delay = if mid_run % 2 == 1 { delay % 40 } else { delay };
            std::thread::sleep(std::time::Duration::from_millis(delay));
            if child.try_wait().expect("try_wait").is_some() {
                break;
            }
            let _ = child.kill();
            let _ = child.wait();
            mid_run += 1;
            killed += 1;
        }
        assert!(
            mid_run > 0,
            "the round's first run finished before its kill"
        );
        let checkpointed = has_complete_checkpoint(&run.ck.join(job));
        if checkpointed {
            let i = weir(&[
                "checkpoints",
                "inspect",
                run.ck.to_str().expect("utf8"),
                "--json",
            ]);
            assert!(i.status.success(), "{}", stderr(&i));
            let v: serde_json::Value = serde_json::from_slice(&i.stdout).expect("json");
            let parts = v["parts"].as_array().expect("parts");
            channel_parts += parts.iter().filter(|p| p["kind"] == "channel").count();
            inspected += 1;
        }
        let o = weir(&run.args());
        assert!(o.status.success(), "{}", stderr(&o));
        if checkpointed {
            // The newest checkpoint, or, when the last killed run was killed before it took
            // one, the checkpoint that run restored (a loaded machine makes that likely).
            let e = stderr(&o);
            assert!(
                e.contains("restoring from checkpoint") || e.contains("which it restored"),
                "the killed runs left checkpoints: {e}"
            );
        }
        check(&run, mid_run);
        // No hidden leftovers are visible to readers, and the checkpoint verifies.
        let v = weir(&["checkpoints", "verify", run.ck.to_str().expect("utf8")]);
        assert!(v.status.success(), "{}", stderr(&v));
    }
    // Some kill came after a checkpoint, so that some restart restored one.
    assert!(inspected > 0, "no killed run left a complete checkpoint");
    if !extra.contains(&"--unaligned") {
        assert_eq!(
            channel_parts, 0,
            "aligned checkpoints hold no channel state"
        );
    } else if !extra.contains(&"--aligned-timeout") {
        assert!(
            channel_parts > 0,
            "no checkpoint of {inspected} inspected was taken unaligned"
        );
    }
}

/// The first number after "offset " in the error text `e`.
fn offset_in(e: &str) -> usize {
    e.split("offset ")
        .skip(1)
        .find_map(|t| t.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .unwrap_or_else(|| panic!("no offset in {e}"))
}

/// Whether `job_dir` holds a complete checkpoint (a `chk-<n>` directory with its metadata).
fn has_complete_checkpoint(job_dir: &Path) -> bool {
    newest_complete_id(job_dir).is_some()
}

/// The id of the newest complete checkpoint in `job_dir` (a `chk-<n>` directory with its
/// metadata), if any.
fn newest_complete_id(job_dir: &Path) -> Option<u64> {
    std::fs::read_dir(job_dir)
        .ok()?
        .flatten()
        .filter(|e| e.path().join("_metadata").exists())
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("chk-")?.parse().ok())
        .max()
}

/// SIGTERM stops a checkpointed `weir run` with a savepoint: exit 0, the savepoint's path
/// on stderr, and the committed output is each key's running sums up to that point. A run
/// restored from the savepoint commits the rest: every running sum exactly once.
#[test]
fn sigterm_stops_with_a_savepoint_that_continues_exactly() {
    sigterm_savepoint_then_restore_onto(2, false);
}

/// The run restored from the savepoint is killed before its first checkpoint; `--restore
/// latest` then continues from the savepoint that run restored (its `RUN_ORIGIN`), not from
/// the beginning, which committed the sums before the savepoint twice.
#[test]
fn restore_latest_after_a_restored_run_killed_before_a_checkpoint_takes_its_savepoint() {
    sigterm_savepoint_then_restore_onto(2, true);
}

/// Stops the running `weir` `child` with SIGTERM once `job_dir` holds a complete checkpoint
/// (so that the savepoint is past the start): its output, which must be a success, and the
/// savepoint it names.
fn stopped_after_a_checkpoint(child: std::process::Child, job_dir: &Path) -> (Output, String) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !has_complete_checkpoint(job_dir) {
        assert!(std::time::Instant::now() < deadline, "no checkpoint");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let k = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(k.success());
    let o = child.wait_with_output().expect("wait");
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let sp = err
        .split("stopped with savepoint ")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .unwrap_or_else(|| panic!("stopped mid-way, with a savepoint named: {err}"))
        .to_string();
    (o, sp)
}

/// `demo` stopped by SIGTERM with a savepoint, then restored from it: together the two runs
/// generate every bid once and emit the windows an uninterrupted run does. The stopped run's
/// generator went on past the savepoint's barrier and fired windows that the restored run
/// fired again (7000 to 9000 windows of 6000).
#[test]
fn demo_stopped_with_a_savepoint_and_restored_emits_each_window_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let ck = dir.path().join("ck");
    let ck_s = ck.to_str().expect("utf8");
    let base = ["run", "demo", "--events", "12000000", "--keys", "1000"];
    // The summary, on standard output.
    let figure = |out: &str, label: &str| -> u64 {
        out.lines()
            .find_map(|l| l.strip_prefix(label))
            .and_then(|r| r.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("{label}: {out}"))
    };
    let stdout = |o: &Output| String::from_utf8_lossy(&o.stdout).into_owned();
    let whole = weir(&base);
    assert!(whole.status.success(), "{}", stderr(&whole));
    let windows = figure(&stdout(&whole), "windows emitted");

    let child = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(base)
        .args(["--checkpoint-dir", ck_s, "--checkpoint-interval", "50ms"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let (o, sp) = stopped_after_a_checkpoint(child, &ck.join("demo"));
    let first = stdout(&o);
    let ck2 = dir.path().join("ck2");
    let mut args = base.to_vec();
    args.extend([
        "--checkpoint-dir",
        ck2.to_str().expect("utf8"),
        "--restore",
        &sp,
    ]);
    let r = weir(&args);
    assert!(r.status.success(), "{}", stderr(&r));
    let second = stdout(&r);
    assert_eq!(
        figure(&first, "bids generated") + figure(&second, "bids generated"),
        12_000_000,
        "{first}{second}"
    );
    assert_eq!(
        figure(&first, "windows emitted") + figure(&second, "windows emitted"),
        windows,
        "{first}{second}"
    );
}

/// The same, restored onto 3 shards: every key's state moves with its key group, and the
/// files the restored run commits hold each key's remaining running sums, exactly once.
#[test]
fn a_savepoint_taken_mid_run_restores_onto_three_shards_exactly() {
    sigterm_savepoint_then_restore_onto(3, false);
}

/// A run on 2 shards stopped by SIGTERM with a savepoint, then restored from it onto
/// `shards` shards; with `killed_first`, a first restored run is killed before it takes a
/// checkpoint, and a second one continues with `--restore latest`.
fn sigterm_savepoint_then_restore_onto(shards: usize, killed_first: bool) {
    let run = CheckpointedRun::new(2_000_000, 997, "2", "50ms");
    let (recs, out) = (&run.recs, &run.out);
    let input = run.dir.path().join("in.csv");
    let ck = run.dir.path().join("ckpt-stop");
    // keyed-sum on `shards` shards into `out`, checkpointing into `dir`, with `extra` flags.
    let args_with = |shards: usize, dir: &Path, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = keyed_sum_args(&input, "csv", out)
            .into_iter()
            .map(str::to_owned)
            .collect();
        let dir = dir.to_str().expect("utf8").to_owned();
        a.extend([
            "--shards".into(),
            shards.to_string(),
            "--checkpoint-dir".into(),
            dir,
        ]);
        a.extend(extra.iter().map(|s| (*s).to_owned()));
        a
    };
    let args = args_with(2, &ck, &["--checkpoint-interval", "50ms"]);
    let child = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let (_, sp) = stopped_after_a_checkpoint(child, &ck.join("keyed-sum"));
    assert!(
        sp.starts_with(ck.join("savepoints").to_str().expect("utf8")),
        "{sp}"
    );
    let want = running_sums(recs);
    let got = parse_sums(&committed_lines(out));
    let committed: usize = got.values().map(Vec::len).sum();
    assert!(
        committed > 0 && committed < recs.len(),
        "stopped mid-way: {committed}"
    );
    for (k, sums) in &got {
        assert!(
            want[k].starts_with(sums),
            "key {k}: its running sums up to the stop"
        );
    }

    let stopped = part_files(out);
    let restored = run.dir.path().join("ckpt-restored");
    let o = if killed_first {
        let args = args_with(
            shards,
            &restored,
            &["--restore", &sp, "--checkpoint-interval", "1h"],
        );
        let mut child = Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(&args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn");
        // Killed once the run recorded where it started, which it does before it runs.
        let origin = restored.join("keyed-sum").join(weir_io::RUN_ORIGIN_FILE);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !origin.exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "no {}",
                origin.display()
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        child.kill().expect("kill");
        child.wait().expect("wait");
        assert!(
            !has_complete_checkpoint(&restored.join("keyed-sum")),
            "killed before a checkpoint"
        );
        let args = args_with(shards, &restored, &["--restore", "latest"]);
        let o = weir(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(stderr(&o).contains("which it restored"), "{}", stderr(&o));
        o
    } else {
        let args = args_with(shards, &restored, &["--restore", &sp]);
        weir(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    assert!(o.status.success(), "{}", stderr(&o));
    // What the stopped run committed stays, and the restored run's own files hold the rest.
    let all = part_files(out);
    assert!(stopped.iter().all(|f| all.contains(f)));
    let fresh: Vec<PathBuf> = all.into_iter().filter(|f| !stopped.contains(f)).collect();
    let rest = parse_sums(&lines_of(&fresh));
    for (k, sums) in &want {
        let before = got.get(k).map_or(0, Vec::len);
        assert_eq!(
            rest.get(k).map_or(&[][..], Vec::as_slice),
            &sums[before..],
            "key {k}: the rest of its running sums, exactly once"
        );
    }
    if shards == 2 {
        // Each key stays on its shard, so its files hold all its sums in order.
        assert_eq!(
            parse_sums(&committed_lines(out)),
            want,
            "every running sum exactly once"
        );
    }
}

#[test]
fn checkpoints_list_and_verify_detect_corruption_with_exit_code_3() {
    let Inputs {
        dir,
        recs,
        input,
        out,
        ck,
    } = Inputs::new(20_000, 31, "jsonl");
    let r = keyed_sum(
        &input,
        "jsonl",
        &out,
        &[
            "--checkpoint-dir",
            ck.to_str().expect("utf8"),
            "--checkpoint-interval",
            "20ms",
        ],
    );
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(parse_sums(&committed_lines(&out)), running_sums(&recs));
    let l = weir(&["checkpoints", "list", ck.to_str().expect("utf8")]);
    assert!(l.status.success());
    let listing = String::from_utf8_lossy(&l.stdout);
    // A header, then one row per checkpoint: job, id, status (word 3), sizes, time.
    let rows: Vec<Vec<&str>> = listing
        .lines()
        .skip(1)
        .map(|r| r.split_whitespace().collect())
        .collect();
    assert!(!rows.is_empty(), "{listing}");
    assert!(
        rows.iter()
            .all(|r| r[0] == "keyed-sum" && r[2] == "complete"),
        "{listing}"
    );
    let v = weir(&["checkpoints", "verify", ck.to_str().expect("utf8")]);
    assert!(v.status.success(), "{}", stderr(&v));
    // A reader that stops early ends the listing as it ends other Unix tools (SIGPIPE), not
    // with a panic (exit 101, "failed printing to stdout").
    for cmd in ["list", "inspect"] {
        let o = weir_to_a_closed_pipe(&["checkpoints", cmd, ck.to_str().expect("utf8")]);
        use std::os::unix::process::ExitStatusExt;
        assert!(
            o.status.success() || o.status.signal() == Some(libc::SIGPIPE),
            "{cmd}: {:?} {}",
            o.status,
            stderr(&o)
        );
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    }
    // Flip a byte of a state file the checkpoint uses.
    let shared = ck.join("keyed-sum").join("shared");
    let f = std::fs::read_dir(&shared)
        .expect("shared")
        .flatten()
        .next()
        .expect("a shared file")
        .path();
    let mut bytes = std::fs::read(&f).expect("read");
    let at = bytes.len() / 2;
    bytes[at] ^= 0x5a;
    std::fs::write(&f, bytes).expect("write");
    let v = weir(&["checkpoints", "verify", ck.to_str().expect("utf8")]);
    assert_eq!(v.status.code(), Some(3), "{}", stderr(&v));
    let e = stderr(&v);
    let name = f.file_name().and_then(|n| n.to_str()).expect("name");
    assert!(
        e.contains(name) && e.contains("offset"),
        "names file and offset: {e}"
    );
    // The offset is the damaged block's: the file is a segment held raw, whose whole-file
    // CRC alone would say offset 0.
    let offset = offset_in(&e);
    assert!(
        offset > 0 && offset <= at,
        "offset {offset}, flipped {at}: {e}"
    );
    // A savepoint of it is refused the same way.
    let sp = dir.path().join("sp");
    let o = weir(&[
        "checkpoints",
        "savepoint",
        ck.to_str().expect("utf8"),
        "--to",
        sp.to_str().expect("utf8"),
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains(name), "{}", stderr(&o));
    // A restore from the corrupt checkpoint stops with that error, not a wrong answer.
    let r = keyed_sum(
        &input,
        "jsonl",
        &out,
        &[
            "--checkpoint-dir",
            ck.to_str().expect("utf8"),
            "--restore",
            "latest",
        ],
    );
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    let e = stderr(&r);
    assert!(
        e.contains(name) && e.contains(&format!("at offset {offset}:")),
        "{e}"
    );
}

/// Flags of a keyed-sum run into checkpoint directory `ck` that keeps several checkpoints.
fn keeping_checkpoints(ck: &str) -> [&str; 6] {
    [
        "--checkpoint-dir",
        ck,
        "--checkpoint-interval",
        "5ms",
        "--retained",
        "4",
    ]
}

/// The keyed-sum job directory in `ck` and the ids of its checkpoints that have metadata,
/// oldest first (at least three).
fn kept_checkpoints(ck: &Path) -> (PathBuf, Vec<u64>) {
    kept_checkpoints_of(ck, "keyed-sum")
}

/// [`kept_checkpoints`] of job `job`.
fn kept_checkpoints_of(ck: &Path, job: &str) -> (PathBuf, Vec<u64>) {
    let job = ck.join(job);
    let mut ids: Vec<u64> = std::fs::read_dir(&job)
        .expect("job dir")
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("chk-")?.parse().ok())
        .filter(|id| job.join(format!("chk-{id}/_metadata")).is_file())
        .collect();
    ids.sort_unstable();
    assert!(ids.len() >= 3, "several retained checkpoints: {ids:?}");
    (job, ids)
}

/// `verify` reports every corrupt checkpoint and verifies the others (it stopped at the first,
/// so the intact ones went unchecked), and a `_metadata` that is a directory damages only its
/// own checkpoint (it failed every command for the whole job with "Is a directory", exit 1),
/// and a savepoint is verified only as the checkpoint it is.
#[test]
fn verify_reports_every_corrupt_checkpoint_and_checks_the_rest() {
    let Inputs {
        dir: _dir,
        input,
        out,
        ck,
        ..
    } = Inputs::new(200_000, 41, "csv");
    let ck_s = ck.to_str().expect("utf8");
    let r = keyed_sum(&input, "csv", &out, &keeping_checkpoints(ck_s));
    assert!(r.status.success(), "{}", stderr(&r));
    let (job, ids) = kept_checkpoints(&ck);
    let (first, second) = (ids[0], ids[1]);
    let meta = |id: u64| job.join(format!("chk-{id}")).join("_metadata");
    let mut bytes = std::fs::read(meta(first)).expect("read");
    bytes[40] ^= 0x10;
    std::fs::write(meta(first), bytes).expect("write");
    std::fs::remove_file(meta(second)).expect("rm");
    std::fs::create_dir(meta(second)).expect("mkdir");

    let l = weir(&["checkpoints", "list", ck_s]);
    assert!(l.status.success(), "{}", stderr(&l));
    let listing = String::from_utf8_lossy(&l.stdout);
    let row = |id: u64| {
        listing
            .lines()
            .find(|r| r.split_whitespace().nth(1) == Some(&id.to_string()))
            .unwrap_or_else(|| panic!("checkpoint {id} listed: {listing}"))
            .to_string()
    };
    assert!(row(second).contains("incomplete") && row(second).contains("a directory"));
    for &id in &ids[2..] {
        assert!(row(id).contains(" complete"), "{listing}");
    }

    let v = weir(&["checkpoints", "verify", ck_s]);
    assert_eq!(v.status.code(), Some(3), "{}", stderr(&v));
    let (e, o) = (stderr(&v), String::from_utf8_lossy(&v.stdout).to_string());
    for id in [first, second] {
        let named = meta(id);
        let line = e
            .lines()
            .find(|l| l.contains(named.to_str().expect("utf8")))
            .unwrap_or_else(|| panic!("checkpoint {id} reported: {e}"));
        assert!(
            line.starts_with("error: ") && line.contains("offset"),
            "{e}"
        );
    }
    assert!(e.contains("2 checkpoints are corrupt"), "{e}");
    for &id in &ids[2..] {
        assert!(o.contains(&format!("ok keyed-sum checkpoint {id}:")), "{o}");
    }
    assert!(!e.contains("panicked"), "{e}");

    // A savepoint verified as another checkpoint is refused, as a `chk-<n>` directory is (it
    // printed "ok savepoint ... (checkpoint <its own>)" and exited 0).
    let newest = *ids.last().expect("one");
    let sp = savepoint_of(
        &ck,
        &job.join(format!("chk-{newest}")),
        &_dir.path().join("sp"),
    );
    let sp_s = sp.to_str().expect("utf8");
    let v = weir(&[
        "checkpoints",
        "verify",
        sp_s,
        "--checkpoint",
        &first.to_string(),
    ]);
    assert_eq!(v.status.code(), Some(1), "{}", stderr(&v));
    assert!(
        stderr(&v).contains(&format!("savepoint of checkpoint {newest}, not {first}")),
        "{}",
        stderr(&v)
    );
    let v = weir(&[
        "checkpoints",
        "verify",
        sp_s,
        "--checkpoint",
        &newest.to_string(),
    ]);
    assert!(v.status.success(), "{}", stderr(&v));
}

/// A segment changed together with the metadata that describes it (here cut short by its
/// footer, its size and CRC in `_metadata` written again) passes the CRC comparison, but not
/// the segment's own checks, which `verify` makes after it, as a restore does: exit code 3,
/// naming the file and the offset.
#[test]
fn verify_checks_segments_beyond_the_crcs_in_the_metadata() {
    let inputs = Inputs::new(5_000, 17, "jsonl");
    inputs.run_checkpointed();
    let Inputs { dir, ck, .. } = inputs;
    let job = ck.join("keyed-sum");
    let (chk, meta_path, mut m) = newest_checkpoint(&job);
    let f = m
        .files
        .iter_mut()
        .find(|f| f.is_raw())
        .expect("a raw segment");
    let seg = job.join(&f.path);
    let mut bytes = std::fs::read(&seg).expect("segment");
    bytes.truncate(bytes.len() - 64);
    std::fs::write(&seg, &bytes).expect("write");
    let (path, size, crc) = (
        f.path.clone(),
        bytes.len() as u64,
        weir_io::crc32(&[&bytes]),
    );
    describe_again(&mut m, &path, size, crc);
    std::fs::write(&meta_path, m.encode()).expect("write metadata");
    let v = weir(&["checkpoints", "verify", chk.to_str().expect("utf8")]);
    assert_eq!(v.status.code(), Some(3), "{}", stderr(&v));
    let e = stderr(&v);
    let name = seg.file_name().and_then(|n| n.to_str()).expect("name");
    assert!(e.contains(name) && e.contains("offset"), "{e}");
    // The whole directory as well.
    let v = weir(&["checkpoints", "verify", ck.to_str().expect("utf8")]);
    assert_eq!(v.status.code(), Some(3), "{}", stderr(&v));
    // A savepoint copies what the metadata describes (its CRCs match); verifying the copy
    // makes the segment checks too.
    let saved = savepoint_of(&ck, &chk, &dir.path().join("sp"));
    let v = weir(&["checkpoints", "verify", saved.to_str().expect("utf8")]);
    assert_eq!(v.status.code(), Some(3), "{}", stderr(&v));
    assert!(stderr(&v).contains(name), "{}", stderr(&v));
}

/// A checkpoint whose shard count was lowered and its metadata's CRC written again passes
/// every CRC; `verify` refuses it as a restore and `inspect` do (exit 3, naming the section
/// and the field). Before, verify said ok and a restore dropped shard 1's state.
#[test]
fn verify_refuses_a_forged_shard_count() {
    let inputs = Inputs::new(2_000, 11, "jsonl");
    inputs.run_checkpointed();
    let Inputs { dir: _dir, ck, .. } = inputs;
    let job = ck.join("keyed-sum");
    let (chk, meta_path, mut m) = newest_checkpoint(&job);
    let (_, bytes) = m
        .sections
        .iter_mut()
        .find(|(name, _)| name == "weir/job")
        .expect("the job section");
    // `shards`, a u32 at bytes 0..4 (docs/checkpoint-format.md): 2 shards become 1.
    assert_eq!(bytes[..4], 2u32.to_le_bytes());
    bytes[..4].copy_from_slice(&1u32.to_le_bytes());
    std::fs::write(&meta_path, m.encode()).expect("write metadata");
    for dir in [&chk, &ck] {
        for cmd in ["verify", "inspect"] {
            let v = weir(&["checkpoints", cmd, dir.to_str().expect("utf8")]);
            assert_eq!(v.status.code(), Some(3), "{cmd}: {}", stderr(&v));
            let e = stderr(&v);
            assert!(
                e.contains("weir/shard-0001") && e.contains("field shards"),
                "{cmd}: {e}"
            );
        }
    }
}

/// A segment taken off the metadata's file list (CRC written again) passed `verify` unread,
/// and retention may delete it under the checkpoint: `verify` and `inspect` now refuse it
/// (exit 3, naming the section and the file), as a restore does. And a copy of a checkpoint
/// under another spelling of its id (`chk-04`) is not a checkpoint directory (exit 1); it was
/// reported as a misdirected savepoint.
#[test]
fn verify_refuses_an_unlisted_file_and_a_misspelled_checkpoint_directory() {
    let inputs = Inputs::new(2_000, 12, "jsonl");
    inputs.run_checkpointed();
    let Inputs { dir: _dir, ck, .. } = inputs;
    let job = ck.join("keyed-sum");
    let (chk, meta_path, mut m) = newest_checkpoint(&job);

    let id = chk
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("chk-"))
        .expect("chk-<n>");
    let misspelled = job.join(format!("chk-0{id}"));
    std::fs::create_dir(&misspelled).expect("mkdir");
    std::fs::copy(&meta_path, misspelled.join("_metadata")).expect("copy");
    for cmd in ["verify", "inspect"] {
        let v = weir(&["checkpoints", cmd, misspelled.to_str().expect("utf8")]);
        assert_eq!(v.status.code(), Some(1), "{cmd}: {}", stderr(&v));
        let e = stderr(&v);
        assert!(e.contains("not a checkpoint directory"), "{cmd}: {e}");
    }
    std::fs::remove_dir_all(&misspelled).expect("rm");

    let parts = weir_runtime::checkpoint::layout(&m).expect("layout").parts;
    let (shard, path) = parts
        .iter()
        .find_map(|p| Some((p.shard, p.files.first()?.0.clone())))
        .expect("a keyed part with a segment");
    m.files.retain(|f| f.path != Path::new(&path));
    std::fs::write(&meta_path, m.encode()).expect("write metadata");
    for dir in [&chk, &ck] {
        for cmd in ["verify", "inspect"] {
            let v = weir(&["checkpoints", cmd, dir.to_str().expect("utf8")]);
            assert_eq!(v.status.code(), Some(3), "{cmd}: {}", stderr(&v));
            let e = stderr(&v);
            assert!(
                e.contains(&format!("weir/shard-{shard:04}"))
                    && e.contains(&format!("references file {path}")),
                "{cmd}: {e}"
            );
        }
    }
}

/// Describes file `path` of checkpoint metadata `m` as `size` bytes with CRC `crc`
/// everywhere the metadata does: its file list, and in the sections the part's file
/// references and the store's snapshot handle inside the part (their encodings hold the size
/// and the CRC side by side, as `u64` and `u32` little-endian), whose own CRC is written again
/// (docs: state/src/handle.rs). A forgery as consistent as one can make, so that only the
/// file's own checks are left to catch it.
fn describe_again(m: &mut weir_io::CheckpointMetadata, path: &Path, size: u64, crc: u32) {
    let f = m
        .files
        .iter_mut()
        .find(|f| f.path == path)
        .expect("a listed file");
    let was = [&f.size_bytes.to_le_bytes()[..], &f.crc32.to_le_bytes()].concat();
    let now = [&size.to_le_bytes()[..], &crc.to_le_bytes()].concat();
    (f.size_bytes, f.crc32) = (size, crc);
    let (mut replaced, mut handles) = (0, 0);
    for (_, bytes) in m.sections.iter_mut() {
        let mut at = 0;
        while let Some(i) = bytes[at..].windows(was.len()).position(|w| w == was) {
            bytes[at + i..at + i + now.len()].copy_from_slice(&now);
            at += i + now.len();
            replaced += 1;
        }
        // Each snapshot handle: "WSNH", a 32-byte head whose bytes 28..32 count the segment
        // records, each 35 bytes and its path, then the CRC of everything before.
        let mut at = 0;
        while let Some(i) = bytes[at..].windows(4).position(|w| w == b"WSNH") {
            let h = at + i;
            let le = |b: &[u8], at: usize, n: usize| {
                b[at..at + n]
                    .iter()
                    .rev()
                    .fold(0usize, |v, &x| v << 8 | usize::from(x))
            };
            let mut end = h + 32;
            for _ in 0..le(bytes, h + 28, 4) {
                end += 35 + le(bytes, end + 33, 2);
            }
            let c = weir_io::crc32(&[&bytes[h..end]]);
            bytes[end..end + 4].copy_from_slice(&c.to_le_bytes());
            at = end + 4;
            handles += 1;
        }
    }
    assert!(replaced > 1 && handles > 0, "{} described", path.display());
}

/// `weir checkpoints savepoint` of checkpoint directory `chk` (of checkpoint directory `ck`)
/// into `to`: the savepoint's directory.
fn savepoint_of(ck: &Path, chk: &Path, to: &Path) -> PathBuf {
    let id = chk
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("chk-"))
        .expect("chk-<n>");
    let o = weir(&[
        "checkpoints",
        "savepoint",
        ck.to_str().expect("utf8"),
        "--checkpoint",
        id,
        "--to",
        to.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::read_dir(to)
        .expect("savepoint dir")
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join("_metadata").is_file())
        .expect("a savepoint")
}

/// The newest checkpoint of job directory `job` (by name: `chk-<n>` of one width here): its
/// directory, its metadata file and that file's content.
fn newest_checkpoint(job: &Path) -> (PathBuf, PathBuf, weir_io::CheckpointMetadata) {
    let mut chks: Vec<PathBuf> = std::fs::read_dir(job)
        .expect("job dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("_metadata").is_file())
        .collect();
    // By id, not by name: `chk-9` sorts after `chk-10`.
    chks.sort_by_key(|p| {
        p.file_name()
            .and_then(|n| n.to_str()?.strip_prefix("chk-")?.parse::<u64>().ok())
    });
    let chk = chks.pop().expect("a checkpoint");
    let meta_path = chk.join("_metadata");
    let m =
        weir_io::CheckpointMetadata::decode(&meta_path, &std::fs::read(&meta_path).expect("read"))
            .expect("metadata");
    (chk, meta_path, m)
}

/// A fresh directory on another file system than the system's temporary directory (where the
/// tests' checkpoint directories are), if this machine has one (`/dev/shm`: a tmpfs).
fn on_another_file_system() -> Option<tempfile::TempDir> {
    use std::os::unix::fs::MetadataExt;
    let tmp = std::fs::metadata(std::env::temp_dir()).ok()?.dev();
    ["/dev/shm", "/run/shm"].iter().find_map(|c| {
        let m = std::fs::metadata(c).ok()?;
        if m.dev() == tmp {
            return None;
        }
        tempfile::Builder::new()
            .prefix("weir-cli-")
            .tempdir_in(c)
            .ok()
    })
}

/// With `--state-dir` on another file system than the checkpoints, segments cannot be
/// hard-linked and are uploaded as copies framed in checksummed blocks. `verify` takes such a
/// segment out of its frames and makes the segment's own checks on it, as for a raw one: a
/// segment changed together with its frames' CRCs and the metadata's content CRC exits 3,
/// naming the framed file and the offset in its content. A restore refuses it too (exit 1).
#[test]
fn verify_checks_framed_segments_too() {
    let Some(state) = on_another_file_system() else {
        eprintln!(
            "skipped: no second file system (/dev/shm) beside {}",
            std::env::temp_dir().display()
        );
        return;
    };
    let Inputs {
        dir,
        input,
        out,
        ck,
        ..
    } = Inputs::new(5_000, 17, "jsonl");
    let (ck_s, state_s) = (
        ck.to_str().expect("utf8"),
        state.path().to_str().expect("utf8"),
    );
    let flags = ["--checkpoint-dir", ck_s, "--state-dir", state_s];
    let r = keyed_sum(&input, "jsonl", &out, &flags);
    assert!(r.status.success(), "{}", stderr(&r));
    // The state went where it was told, and the intact framed checkpoint verifies.
    assert!(state.path().join("shard-0").is_dir());
    let v = weir(&["checkpoints", "verify", ck_s]);
    assert!(v.status.success(), "{}", stderr(&v));
    // Without a temporary directory for the scratch copy, that is this machine's problem,
    // not the checkpoint's: exit 1, not 3.
    let v = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(["checkpoints", "verify", ck_s])
        .env("TMPDIR", dir.path().join("no-such-dir"))
        .output()
        .expect("weir runs");
    assert_eq!(v.status.code(), Some(1), "{}", stderr(&v));
    assert!(stderr(&v).contains("scratch directory"), "{}", stderr(&v));
    let job = ck.join("keyed-sum");
    let (chk, meta_path, mut m) = newest_checkpoint(&job);
    let f = m
        .files
        .iter_mut()
        .find(|f| !f.is_raw())
        .expect("a framed segment: a hard link across file systems fails");
    let framed = job.join(&f.path);
    let mut bytes = std::fs::read(&framed).expect("framed file");
    // The frames follow the data file header; each is a block header and its payload.
    let (first, head) = (weir_io::DATA_HEADER_LEN, weir_io::BLOCK_HEADER_LEN);
    let payload_len = |b: &[u8], at: usize| {
        u32::from_le_bytes(b[at + 16..at + 20].try_into().expect("4 bytes")) as usize
    };
    // Content byte 70 is in the segment's first entry (after its 32-byte file header, the
    // first block's 24-byte header and 8-byte data header): the segment's block CRC fails.
    let len = payload_len(&bytes, first);
    assert!(len > 70, "a first frame of {len} bytes");
    bytes[first + head + 70] ^= 0x01;
    let crc = weir_io::crc32(&[
        &bytes[first..first + 20],
        &bytes[first + head..first + head + len],
    ]);
    bytes[first + 20..first + 24].copy_from_slice(&crc.to_le_bytes());
    let mut content = Vec::new();
    let mut at = first;
    while at < bytes.len() {
        let len = payload_len(&bytes, at);
        content.extend_from_slice(&bytes[at + head..at + head + len]);
        at += head + len;
    }
    assert_eq!(content.len() as u64, f.size_bytes);
    let (path, size) = (f.path.clone(), f.size_bytes);
    describe_again(&mut m, &path, size, weir_io::crc32(&[&content]));
    std::fs::write(&framed, &bytes).expect("write");
    std::fs::write(&meta_path, m.encode()).expect("write metadata");
    let name = framed.file_name().and_then(|n| n.to_str()).expect("name");
    // The checkpoint, its job's directory, and a savepoint made of it (a copy whose CRCs
    // match, as `savepoint` checks).
    let saved = savepoint_of(&ck, &chk, &dir.path().join("sp"));
    for d in [&chk, &ck, &saved] {
        let v = weir(&["checkpoints", "verify", d.to_str().expect("utf8")]);
        assert_eq!(v.status.code(), Some(3), "{}", stderr(&v));
        let e = stderr(&v);
        assert!(
            e.contains(name) && e.contains("content of the framed file") && e.contains("offset"),
            "{e}"
        );
        // The damaged block's offset in the content: after the segment's 32-byte file header,
        // at or before the flipped byte 70.
        let offset = offset_in(&e);
        assert!((32..=70).contains(&offset), "offset {offset}: {e}");
    }
    let mut again = flags.to_vec();
    again.extend(["--restore", "latest"]);
    let r = keyed_sum(&input, "jsonl", &out, &again);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(stderr(&r).contains(name), "{}", stderr(&r));
}

/// With a checkpoint directory (and so a restart strategy) a mistake in the input is still one
/// line and exit code 1: a malformed line under the fail policy, an unknown column and a
/// missing input would fail every restart the same way. Before, the job restarted forever.
#[test]
fn input_errors_of_a_checkpointing_job_exit_at_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let input = dir.path().join("in.csv");
    std::fs::write(&input, "user,amount\na,1\nb,x\n").expect("write");
    let unknown = dir.path().join("unknown.csv");
    std::fs::write(&unknown, "name,amount\na,1\n").expect("write");
    let (out, ck) = (dir.path().join("out"), dir.path().join("ck"));
    let run = |input: &Path| {
        let mut args = keyed_sum_args(input, "csv", &out);
        args.extend(["--checkpoint-dir", ck.to_str().expect("utf8")]);
        weir_within(&args, 60)
    };
    let o = run(&input);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("in.csv:3"), "{}", stderr(&o));
    assert!(!stderr(&o).contains("restarting"), "{}", stderr(&o));
    let o = run(&unknown);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("unknown column `user`"),
        "{}",
        stderr(&o)
    );
    let o = run(&dir.path().join("missing.csv"));
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("missing.csv"), "{}", stderr(&o));
}

/// `checkpoints verify` and `checkpoints savepoint` beside a running job: the job's retention
/// drops checkpoints while they are verified or copied, which is not corruption (verify was
/// exit 3 in 1 of ~100 verifications beside a job checkpointing every 10 ms) and no reason to
/// fail (savepoint was exit 1, "checkpoint N not found", in 3 of 20). Every one exits 0 here,
/// each savepoint made verifies, and no partial copy is left beside them; the race is not
/// forced, so a run where it never happens passes as well.
#[test]
fn verify_and_savepoint_beside_a_running_job_succeed() {
    // One shard: a longer job, more checkpoints dropped while verified.
    let run = CheckpointedRun::new(3_000_000, 997, "1", "10ms");
    let mut job = run.spawn();
    let ck_s = run.ck.to_str().expect("utf8");
    let sp_root = run.dir.path().join("savepoints");
    let sp_s = sp_root.to_str().expect("utf8");
    let (mut verified, mut saved) = (0, Vec::new());
    let job_dir = run.ck.join("keyed-sum");
    while job.try_wait().expect("wait").is_none() {
        let had_one = has_complete_checkpoint(&job_dir);
        let v = weir(&["checkpoints", "verify", ck_s]);
        assert_ne!(v.status.code(), Some(3), "{}", stderr(&v));
        // Exit 1 only before the first checkpoint completed: retention keeps one complete.
        assert!(
            v.status.success() || !had_one,
            "exit {:?} with a complete checkpoint: {}",
            v.status.code(),
            stderr(&v)
        );
        verified += usize::from(v.status.success());
        let had_one = has_complete_checkpoint(&job_dir);
        let s = weir(&["checkpoints", "savepoint", ck_s, "--to", sp_s]);
        assert_ne!(s.status.code(), Some(3), "{}", stderr(&s));
        assert!(
            s.status.success() || !had_one,
            "savepoint: exit {:?} with a complete checkpoint: {}",
            s.status.code(),
            stderr(&s)
        );
        if s.status.success() {
            saved.push(String::from_utf8_lossy(&s.stdout).trim().to_string());
        }
    }
    assert!(job.wait().expect("wait").success());
    assert!(verified > 0, "no verification ran while the job did");
    assert!(!saved.is_empty(), "no savepoint was made while the job ran");
    let mut dirs: Vec<String> = std::fs::read_dir(&sp_root)
        .expect("savepoints")
        .flatten()
        .map(|e| e.path().to_str().expect("utf8").to_string())
        .collect();
    dirs.sort();
    saved.sort();
    assert_eq!(dirs, saved, "only whole savepoints are there");
    for sp in &saved {
        let v = weir(&["checkpoints", "verify", sp]);
        assert!(v.status.success(), "{sp}: {}", stderr(&v));
    }
}

/// A checkpoint whose `_metadata` is corrupt did complete (the file is renamed into place
/// whole), so its sink output may be committed: `--restore latest` stops and names the file
/// and offset, rather than start over as if there were no checkpoint and write every result
/// a second time (what it did before: 60000 lines for 30000 records). The same when the
/// metadata is removed: the job directory's `COMPLETED` record says it completed, and
/// `weir checkpoints verify` reports the checkpoint as corrupt (exit 3).
#[test]
fn a_corrupt_metadata_file_stops_restore_latest_instead_of_starting_over() {
    let run = CheckpointedRun::new(30_000, 500, "2", "20ms");
    let (dir, recs, out, ck, args) = (&run.dir, &run.recs, &run.out, &run.ck, run.args());
    let r = weir(&args);
    assert!(r.status.success(), "{}", stderr(&r));
    let want = running_sums(recs);
    assert_eq!(parse_sums(&committed_lines(out)), want);
    // The newest checkpoint: the final one, which committed the sink's last files.
    let newest = std::fs::read_dir(ck.join("keyed-sum"))
        .expect("job dir")
        .flatten()
        .filter_map(|e| {
            let n = e
                .file_name()
                .to_str()?
                .strip_prefix("chk-")?
                .parse::<u64>()
                .ok()?;
            Some((n, e.path()))
        })
        .max()
        .expect("a checkpoint")
        .1;
    let meta = newest.join("_metadata");
    let mut corrupt = std::fs::read(&meta).expect("read");
    let at = corrupt.len() / 3;
    corrupt[at] ^= 0x10;
    std::fs::write(&meta, &corrupt).expect("write");
    let r = weir(&args);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    let e = stderr(&r);
    assert!(
        e.contains(meta.to_str().expect("utf8")) && e.contains("offset"),
        "names the metadata file and offset: {e}"
    );
    assert!(!e.contains("starting from the beginning"), "{e}");
    assert_eq!(
        parse_sums(&committed_lines(out)),
        want,
        "the committed output is as it was: nothing written twice"
    );
    // Removed outright rather than corrupted, the metadata no longer says the checkpoint
    // completed; the job directory's COMPLETED record does, and the restore stops the same way.
    std::fs::remove_file(&meta).expect("remove");
    let r = weir(&args);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    let e = stderr(&r);
    assert!(e.contains("COMPLETED") && e.contains("is gone"), "{e}");
    assert_eq!(
        parse_sums(&committed_lines(out)),
        want,
        "nothing written twice"
    );
    // `verify` refuses what the restore refuses: the directory, and that checkpoint by id,
    // are corrupt (exit 3), naming the record and the missing file.
    let ck_s = ck.to_str().expect("utf8");
    let id = newest
        .file_name()
        .and_then(|n| n.to_str()?.strip_prefix("chk-").map(str::to_owned))
        .expect("chk-<n>");
    let newest_s = newest.to_str().expect("utf8");
    for verify in [
        vec!["checkpoints", "verify", ck_s],
        vec!["checkpoints", "verify", ck_s, "--checkpoint", &id],
        // Named by its own directory (it was "no checkpoints", exit 1).
        vec!["checkpoints", "verify", newest_s],
    ] {
        let r = weir(&verify);
        let e = stderr(&r);
        assert_eq!(r.status.code(), Some(3), "{verify:?}: {e}");
        assert!(
            e.contains("COMPLETED") && e.contains(meta.to_str().expect("utf8")),
            "{verify:?}: {e}"
        );
    }
    // `list` says why it is not merely incomplete.
    let r = weir(&["checkpoints", "list", ck_s, "--json"]);
    assert!(r.status.success(), "{}", stderr(&r));
    let row = String::from_utf8_lossy(&r.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json"))
        .find(|v| v["checkpoint"].as_u64() == id.parse().ok())
        .expect("the checkpoint is listed");
    assert_eq!(row["status"], "incomplete");
    let problem = row["problem"].as_str().expect("a problem");
    assert!(problem.contains("COMPLETED names it"), "{problem}");
    // Its whole directory removed, storage lists nothing of it: `list` still shows it, as a
    // restore still stops at it (a copy, so that the checks below keep the directory).
    let bare = dir.path().join("bare");
    copy_tree(ck, &bare);
    std::fs::remove_dir_all(bare.join("keyed-sum").join(format!("chk-{id}"))).expect("rm");
    let r = weir(&["checkpoints", "list", bare.to_str().expect("utf8")]);
    assert!(r.status.success(), "{}", stderr(&r));
    let listed = String::from_utf8_lossy(&r.stdout).to_string();
    assert!(
        listed
            .lines()
            .any(|l| l.contains(&format!(" {id} incomplete")) && l.contains("no directory")),
        "{listed}"
    );
    std::fs::write(&meta, &corrupt).expect("write");
    // The tools that pick the newest checkpoint report it as corrupt too.
    let sp = dir.path().join("sp");
    for args in [
        vec!["checkpoints", "inspect", ck_s],
        vec![
            "checkpoints",
            "savepoint",
            ck_s,
            "--to",
            sp.to_str().expect("utf8"),
        ],
        vec!["checkpoints", "verify", ck_s],
    ] {
        let o = weir(&args);
        assert_eq!(o.status.code(), Some(3), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("_metadata"), "{args:?}: {}", stderr(&o));
    }
}

/// The job directory's `COMPLETED` record damaged: beside checkpoints that kept their
/// metadata it is what a power cut can leave (it is replaced without a sync), and changes
/// nothing; with no `_metadata` left anywhere, a checkpoint completed (only one writes the
/// record) and its metadata was removed since, so `--restore latest` stops, naming the record
/// and offset, rather than start from the beginning and commit the output twice (before, the
/// damaged record said nothing and the run started over); `verify` exits 3 the same way, and
/// `--allow-fallback` starts over.
/// A `RUN_ORIGIN` that does not decode: `verify` reports it as corruption (exit 3) and a
/// restore from `latest` stops (exit 1), each naming the file and the offset, rather than
/// guess which checkpoint continues the last run.
#[test]
fn a_damaged_run_origin_is_reported_and_stops_restore_latest() {
    let run = CheckpointedRun::new(30_000, 500, "2", "20ms");
    let (out, ck, args) = (&run.out, &run.ck, run.args());
    let r = weir(&args);
    assert!(r.status.success(), "{}", stderr(&r));
    let committed = committed_lines(out);
    let origin = ck.join("keyed-sum").join(weir_io::RUN_ORIGIN_FILE);
    let mut bytes = std::fs::read(&origin).expect("the run recorded where it started");
    bytes[0] ^= 0x01;
    std::fs::write(&origin, &bytes).expect("write");
    let r = weir(&["checkpoints", "verify", ck.to_str().expect("utf8")]);
    assert_eq!(r.status.code(), Some(3), "{}", stderr(&r));
    let named = |e: &str| e.contains(origin.to_str().expect("utf8")) && e.contains("offset");
    assert!(named(&stderr(&r)), "{}", stderr(&r));
    let r = weir(&args);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(named(&stderr(&r)), "{}", stderr(&r));
    assert_eq!(committed_lines(out), committed, "the output is left alone");
}

#[test]
fn a_damaged_completed_record_with_no_metadata_left_stops_restore_latest() {
    let run = CheckpointedRun::new(30_000, 500, "2", "20ms");
    let (recs, out, ck, args) = (&run.recs, &run.out, &run.ck, run.args());
    let r = weir(&args);
    assert!(r.status.success(), "{}", stderr(&r));
    let want = running_sums(recs);
    assert_eq!(parse_sums(&committed_lines(out)), want);
    let job = ck.join("keyed-sum");
    let record = job.join("COMPLETED");
    let mut torn = std::fs::read(&record).expect("read");
    torn[0] ^= 0x01;
    std::fs::write(&record, &torn).expect("write");
    let ck_s = ck.to_str().expect("utf8");
    // The checkpoints' metadata is there: a restore and `verify` go on as before.
    let r = weir(&["checkpoints", "verify", ck_s]);
    assert!(r.status.success(), "{}", stderr(&r));
    let r = weir(&args);
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(
        stderr(&r).contains("restoring from checkpoint"),
        "{}",
        stderr(&r)
    );
    assert_eq!(parse_sums(&committed_lines(out)), want);
    // The restore's run wrote a fresh record; damage it, and remove every metadata file.
    std::fs::write(&record, &torn).expect("write");
    for e in std::fs::read_dir(&job).expect("job dir").flatten() {
        let meta = e.path().join("_metadata");
        if meta.exists() {
            std::fs::remove_file(meta).expect("rm");
        }
    }
    let r = weir(&["checkpoints", "verify", ck_s]);
    assert_eq!(r.status.code(), Some(3), "{}", stderr(&r));
    assert!(
        stderr(&r).contains(record.to_str().expect("utf8")) && stderr(&r).contains("offset"),
        "{}",
        stderr(&r)
    );
    let r = weir(&args);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    let e = stderr(&r);
    assert!(
        e.contains(record.to_str().expect("utf8"))
            && e.contains("offset")
            && e.contains("--allow-fallback"),
        "{e}"
    );
    assert!(!e.contains("starting from the beginning;"), "{e}");
    assert_eq!(
        parse_sums(&committed_lines(out)),
        want,
        "nothing written twice"
    );
    // Allowed, the run starts over (and so commits every sum a second time).
    let mut again = args.clone();
    again.push("--allow-fallback");
    let r = weir(&again);
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(
        stderr(&r).contains("starting from the beginning"),
        "{}",
        stderr(&r)
    );
    let twice: usize = parse_sums(&committed_lines(out))
        .values()
        .map(Vec::len)
        .sum();
    assert_eq!(twice, 2 * recs.len());
}

#[test]
fn checkpoints_inspect_shows_the_parts_and_clean_keeps_the_newest() {
    let Inputs {
        dir,
        recs,
        input,
        out,
        ck,
    } = Inputs::new(200_000, 97, "csv");
    let ck_s = ck.to_str().expect("utf8");
    let r = keyed_sum(
        &input,
        "csv",
        &out,
        &[
            "--shards",
            "2",
            "--checkpoint-dir",
            ck_s,
            "--checkpoint-interval",
            "5ms",
            "--retained",
            "4",
        ],
    );
    assert!(r.status.success(), "{}", stderr(&r));
    let complete = || -> Vec<u64> {
        let l = weir(&["checkpoints", "list", ck_s, "--json"]);
        assert!(l.status.success(), "{}", stderr(&l));
        String::from_utf8_lossy(&l.stdout)
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json"))
            .filter(|v| v["status"] == "complete")
            .map(|v| v["checkpoint"].as_u64().expect("id"))
            .collect()
    };
    let before = complete();
    assert!(
        before.len() >= 2,
        "several retained checkpoints: {before:?}"
    );
    let newest = *before.last().expect("one");

    // Inspect the newest: the job's shape and every shard's parts.
    let i = weir(&["checkpoints", "inspect", ck_s, "--json"]);
    assert!(i.status.success(), "{}", stderr(&i));
    let v: serde_json::Value = serde_json::from_slice(&i.stdout).expect("one JSON object");
    assert_eq!(v["job"], "keyed-sum");
    assert_eq!(v["checkpoint"].as_u64(), Some(newest));
    assert_eq!(v["kind"], "checkpoint");
    assert_eq!(v["shards"], 2);
    let parts = v["parts"].as_array().expect("parts");
    for shard in 0..2 {
        let kinds: Vec<&str> = parts
            .iter()
            .filter(|p| p["shard"] == shard)
            .map(|p| p["kind"].as_str().expect("kind"))
            .collect();
        for k in ["source", "keyed", "sink"] {
            assert!(
                kinds.contains(&k),
                "shard {shard} has a {k} part: {kinds:?}"
            );
        }
    }
    // Each operator by its stable uid, the output's sink included.
    let mut ops: Vec<(&str, &str)> = parts
        .iter()
        .map(|p| {
            (
                p["operator"].as_str().expect("operator"),
                p["kind"].as_str().expect("kind"),
            )
        })
        .collect();
    ops.sort_unstable();
    ops.dedup();
    assert_eq!(
        ops,
        [
            ("input", "source"),
            ("keyed-sum", "keyed"),
            ("keyed-sum", "state-types"),
            ("output", "sink")
        ]
    );
    // The parts' files are the checkpoint's files.
    let mut part_files: Vec<&str> = parts
        .iter()
        .flat_map(|p| p["files"].as_array().expect("files"))
        .map(|f| f["path"].as_str().expect("path"))
        .collect();
    part_files.sort_unstable();
    let files: Vec<&str> = v["files"]
        .as_array()
        .expect("files")
        .iter()
        .map(|f| f["path"].as_str().expect("path"))
        .collect();
    assert!(!files.is_empty());
    assert_eq!(part_files, files);
    // An older one by number, or by its directory; text names the operator.
    let older = before[0].to_string();
    let i = weir(&["checkpoints", "inspect", ck_s, "--checkpoint", &older]);
    assert!(i.status.success(), "{}", stderr(&i));
    let text = String::from_utf8_lossy(&i.stdout);
    assert!(
        text.contains(&format!("checkpoint {older}")) && text.contains("keyed-sum"),
        "{text}"
    );
    let chk = ck.join("keyed-sum").join(format!("chk-{older}"));
    let i = weir(&["checkpoints", "inspect", chk.to_str().expect("utf8")]);
    assert!(i.status.success(), "{}", stderr(&i));
    let i = weir(&[
        "checkpoints",
        "inspect",
        chk.to_str().expect("utf8"),
        "--checkpoint",
        "999999",
    ]);
    assert_eq!(
        i.status.code(),
        Some(1),
        "a chk-<n> and another --checkpoint"
    );
    let i = weir(&["checkpoints", "inspect", ck_s, "--checkpoint", "999999"]);
    assert_eq!(i.status.code(), Some(1), "{}", stderr(&i));

    // Clean refuses while the job's directory is locked (a running job holds the lock).
    let lock = weir_io::DirLock::acquire(&ck.join("keyed-sum")).expect("lock");
    let c = weir(&["checkpoints", "clean", ck_s]);
    assert_eq!(c.status.code(), Some(1), "{}", stderr(&c));
    assert_eq!(complete(), before, "nothing removed while locked");
    drop(lock);
    let c = weir(&["checkpoints", "clean", ck_s, "--keep", "1"]);
    assert!(c.status.success(), "{}", stderr(&c));
    assert!(
        String::from_utf8_lossy(&c.stdout).contains(&format!("kept [{newest}]")),
        "{}",
        String::from_utf8_lossy(&c.stdout)
    );
    assert_eq!(complete(), vec![newest]);
    // What is left verifies, and every file left is one the kept checkpoint uses.
    let ver = weir(&["checkpoints", "verify", ck_s]);
    assert!(ver.status.success(), "{}", stderr(&ver));
    let mut left: Vec<String> = std::fs::read_dir(ck.join("keyed-sum").join("shared"))
        .expect("shared")
        .flatten()
        .map(|e| format!("shared/{}", e.file_name().to_string_lossy()))
        .collect();
    left.sort();
    assert_eq!(left, files);
    // A savepoint of the kept checkpoint: self-contained, inspectable, restorable.
    let sps = dir.path().join("savepoints");
    let s = weir(&[
        "checkpoints",
        "savepoint",
        ck_s,
        "--to",
        sps.to_str().expect("utf8"),
    ]);
    assert!(s.status.success(), "{}", stderr(&s));
    let sp = String::from_utf8_lossy(&s.stdout).trim().to_string();
    assert!(
        sp.starts_with(sps.to_str().expect("utf8")) && sp.contains(&format!("savepoint-{newest}-")),
        "{sp}"
    );
    let ver = weir(&["checkpoints", "verify", &sp]);
    assert!(ver.status.success(), "{}", stderr(&ver));
    assert!(String::from_utf8_lossy(&ver.stdout).starts_with("ok savepoint"));
    let chk = ck.join("keyed-sum").join(format!("chk-{newest}"));
    let ver = weir(&["checkpoints", "verify", chk.to_str().expect("utf8")]);
    assert!(ver.status.success(), "{}", stderr(&ver));
    let i = weir(&["checkpoints", "inspect", &sp, "--json"]);
    assert!(i.status.success(), "{}", stderr(&i));
    let v: serde_json::Value = serde_json::from_slice(&i.stdout).expect("json");
    assert_eq!(v["kind"], "savepoint");
    assert_eq!(v["checkpoint"].as_u64(), Some(newest));
    let restored = dir.path().join("ckpt-restored");
    let r = keyed_sum(
        &input,
        "csv",
        &out,
        &[
            "--shards",
            "3",
            "--checkpoint-dir",
            restored.to_str().expect("utf8"),
            "--restore",
            &sp,
        ],
    );
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(parse_sums(&committed_lines(&out)), running_sums(&recs));
    // Into another output directory: the savepoint's output stays where it was written, and
    // the restored job (past the end of its input) adds nothing.
    let elsewhere = dir.path().join("out-elsewhere");
    let ck_elsewhere = dir.path().join("ckpt-elsewhere");
    let r = keyed_sum(
        &input,
        "csv",
        &elsewhere,
        &[
            "--checkpoint-dir",
            ck_elsewhere.to_str().expect("utf8"),
            "--restore",
            &sp,
        ],
    );
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(committed_lines(&elsewhere).is_empty());
    assert_eq!(parse_sums(&committed_lines(&out)), running_sums(&recs));
    // Into another job: the demo has none of keyed-sum's operators, so the restore is
    // refused before it runs (exit 1, naming them), unless their state may be skipped.
    let demo = |extra: &[&str]| {
        let ck_demo = tempfile::tempdir_in(dir.path()).expect("tmp");
        let mut args = vec!["run", "demo", "--events", "20000", "--restore", &sp];
        args.extend(["--checkpoint-dir", ck_demo.path().to_str().expect("utf8")]);
        args.extend(extra);
        weir(&args)
    };
    let d = demo(&[]);
    assert_eq!(d.status.code(), Some(1), "{}", stderr(&d));
    assert!(
        stderr(&d).contains("`keyed-sum` (keyed)")
            && stderr(&d).contains("--allow-non-restored-state"),
        "{}",
        stderr(&d)
    );
    let d = demo(&["--allow-non-restored-state"]);
    assert!(d.status.success(), "{}", stderr(&d));
    assert!(
        stderr(&d).contains("skipping the state of"),
        "{}",
        stderr(&d)
    );
    // Without a checkpoint directory the output would go through a plain sink, which cannot
    // publish what the savepoint had prepared: refused before the job starts.
    let plain = dir.path().join("out-plain");
    let r = keyed_sum(&input, "csv", &plain, &["--restore", &sp]);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(
        stderr(&r).contains("--restore needs --checkpoint-dir"),
        "{}",
        stderr(&r)
    );
    assert!(!plain.exists(), "nothing written");
    // A corrupt metadata file is exit code 3 for inspect too, naming the file.
    let meta = ck
        .join("keyed-sum")
        .join(format!("chk-{newest}"))
        .join("_metadata");
    let mut bytes = std::fs::read(&meta).expect("metadata");
    let at = bytes.len() / 2;
    bytes[at] ^= 0x5a;
    std::fs::write(&meta, bytes).expect("write");
    let chk = ck.join("keyed-sum").join(format!("chk-{newest}"));
    let i = weir(&["checkpoints", "inspect", chk.to_str().expect("utf8")]);
    assert_eq!(i.status.code(), Some(3), "{}", stderr(&i));
    assert!(stderr(&i).contains("_metadata"), "{}", stderr(&i));
}

#[test]
fn a_too_small_memlock_limit_is_a_clear_error_with_a_hint() {
    let o = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -l 64 && exec {} run demo --events 1000",
            env!("CARGO_BIN_EXE_weir")
        ))
        .output()
        .expect("bash");
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("RLIMIT_MEMLOCK") && e.contains("hint"), "{e}");
    assert!(!e.contains("panicked"), "{e}");
}

/// Input, output and dead-letter paths that overlap are refused before anything is written.
/// Before, `--input OUT/part-0.csv --output OUT` truncated the input and exited 0 with
/// "0 records in", and a dead-letter file that was the input had dead letters appended to it.
#[test]
fn overlapping_input_output_and_dead_letter_paths_are_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let text = "user,amount\na,1\nb,x\n";
    let out = dir.path().join("out");
    std::fs::create_dir(&out).expect("mkdir");
    let inside = out.join("part-0.csv");
    std::fs::write(&inside, text).expect("write");
    let r = keyed_sum(&inside, "csv", &out, &[]);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(stderr(&r).contains("is inside --output"), "{}", stderr(&r));
    assert_eq!(std::fs::read_to_string(&inside).expect("input"), text);
    // One directory spelled two ways: its part files would be the next run's input.
    let same = out.join(".");
    let r = keyed_sum(&out, "csv", &same, &[]);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(stderr(&r).contains("is --output"), "{}", stderr(&r));

    let input = dir.path().join("in.csv");
    std::fs::write(&input, text).expect("write");
    let elsewhere = dir.path().join("out2");
    let policy = |p: &Path| format!("dead-letter={}", p.display());
    let r = keyed_sum(&input, "csv", &elsewhere, &["--on-error", &policy(&input)]);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(
        stderr(&r).contains("is --input") && stderr(&r).contains("in.csv"),
        "{}",
        stderr(&r)
    );
    assert_eq!(std::fs::read_to_string(&input).expect("input"), text);
    let in_out = elsewhere.join("part-0.csv");
    let r = keyed_sum(&input, "csv", &elsewhere, &["--on-error", &policy(&in_out)]);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(stderr(&r).contains("inside --output"), "{}", stderr(&r));
    let r = keyed_sum(&input, "csv", &elsewhere, &["--on-error", &policy(&out)]);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(stderr(&r).contains("is a directory"), "{}", stderr(&r));
    assert!(!elsewhere.exists(), "nothing written");
    // Output inside an input directory: written into the input (it exited 0).
    let in_dir = dir.path().join("in-dir");
    std::fs::create_dir(&in_dir).expect("mkdir");
    std::fs::write(in_dir.join("a.csv"), text).expect("write");
    let r = keyed_sum(&in_dir, "csv", &in_dir.join("out"), &[]);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(stderr(&r).contains("is inside --input"), "{}", stderr(&r));
    assert!(!in_dir.join("out").exists(), "nothing written");
    // A file of an input directory that links into --output (the run truncated it, and
    // "succeeded" with 0 records in).
    let part = out.join("part-0.csv");
    std::os::unix::fs::symlink(&part, in_dir.join("b.csv")).expect("symlink");
    let r = keyed_sum(&in_dir, "csv", &out, &[]);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(
        stderr(&r).contains("b.csv") && stderr(&r).contains("inside --output"),
        "{}",
        stderr(&r)
    );
    assert_eq!(std::fs::read_to_string(&part).expect("input"), text);
}

/// One job per output directory, with checkpoints or without: a run without checkpoints took
/// no lock, and deleted the published part files of a checkpointed job running there.
#[test]
fn a_run_without_checkpoints_refuses_an_output_directory_in_use() {
    let inputs = Inputs::new(3_000, 23, "csv");
    let out = inputs.dir.path().join("busy");
    std::fs::create_dir(&out).expect("mkdir");
    std::fs::write(out.join("part-0-0.csv"), "a,1\n").expect("published");
    // The lock as a running job holds it.
    let held =
        weir_io::DirLock::acquire_named(&out, weir_runtime::sink::SINK_LOCK_FILE).expect("lock");
    let r = keyed_sum(&inputs.input, "csv", &out, &[]);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(
        stderr(&r).contains("in use by another job"),
        "{}",
        stderr(&r)
    );
    assert_eq!(
        std::fs::read_to_string(out.join("part-0-0.csv")).expect("still there"),
        "a,1\n"
    );
    drop(held);
    // A part file's name that is a link to a file elsewhere: the link goes, not the file, and
    // nothing is written through it.
    let elsewhere = inputs.dir.path().join("keep.csv");
    std::fs::write(&elsewhere, "mine\n").expect("write");
    std::os::unix::fs::symlink(&elsewhere, out.join("part-0.csv")).expect("symlink");
    let r = keyed_sum(&inputs.input, "csv", &out, &[]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(
        parse_sums(&committed_lines(&out)),
        running_sums(&inputs.recs)
    );
    assert_eq!(std::fs::read_to_string(&elsewhere).expect("kept"), "mine\n");
}

/// A run without checkpoints writes into a hidden staging directory and replaces the earlier
/// output only when it has finished: one that failed as it set up (an unknown column) had
/// already truncated the earlier part files, and one that failed at a malformed line left
/// half its output in their place.
#[test]
fn a_run_without_checkpoints_that_fails_leaves_the_earlier_output() {
    let Inputs {
        dir,
        recs,
        input,
        out,
        ..
    } = Inputs::new(20_000, 31, "csv");
    let r = keyed_sum(&input, "csv", &out, &["--shards", "3"]);
    assert!(r.status.success(), "{}", stderr(&r));
    let before = committed_lines(&out);
    assert_eq!(parse_sums(&before), running_sums(&recs));
    // Fails as it sets up.
    let mut bad_key = keyed_sum_args(&input, "csv", &out);
    let k = bad_key.iter().position(|a| *a == "user").expect("--key");
    bad_key[k] = "nope";
    let r = weir(&bad_key);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert_eq!(committed_lines(&out), before);
    // Fails at a malformed line near the end, after most records went out.
    let bad = dir.path().join("bad.csv");
    let mut text = std::fs::read_to_string(&input).expect("input");
    text.push_str("u1,not-a-number,1\n");
    std::fs::write(&bad, text).expect("write");
    let r = keyed_sum(&bad, "csv", &out, &[]);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(stderr(&r).contains("not-a-number"), "{}", stderr(&r));
    assert_eq!(committed_lines(&out), before);
    // What a killed run left in the staging directory is cleared; a run on fewer shards
    // leaves no part file of the earlier run's third shard.
    let staging = out.join(".weir-staging");
    std::fs::create_dir_all(&staging).expect("mkdir");
    std::fs::write(staging.join("part-7.csv"), "stale,1\n").expect("write");
    let r = keyed_sum(&input, "csv", &out, &["--shards", "2"]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(!staging.exists(), "staging directory removed");
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .expect("out")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    names.sort();
    assert_eq!(names, ["part-0.csv", "part-1.csv"]);
    assert_eq!(parse_sums(&committed_lines(&out)), running_sums(&recs));
}

/// `--restore` of a checkpoint older than output the job committed since, into the same
/// `--output`, stops before it changes anything (it exited 0 with that output's records in
/// the directory twice); `--allow-fallback` accepts the duplicates.
#[test]
fn restoring_an_older_checkpoint_behind_committed_output_stops() {
    let Inputs {
        dir: _dir,
        recs,
        input,
        out,
        ck,
    } = Inputs::new(200_000, 43, "csv");
    let ck_s = ck.to_str().expect("utf8");
    // Every checkpoint is kept: the restore of the newest below takes checkpoints of its
    // own, and with a small retention they could subsume the older one this test restores
    // last (CI saw checkpoint 6 gone that way).
    let args = [
        "--checkpoint-dir",
        ck_s,
        "--checkpoint-interval",
        "5ms",
        "--retained",
        "100000",
    ];
    let r = keyed_sum(&input, "csv", &out, &args);
    assert!(r.status.success(), "{}", stderr(&r));
    let (job, ids) = kept_checkpoints(&ck);
    let older_id = ids[1];
    let older = job.join(format!("chk-{older_id}"));
    let before = committed_lines(&out);
    let restore = |extra: &[&str]| {
        let older = older.to_str().expect("utf8");
        let flags = [&args[..], &["--restore", older], extra].concat();
        keyed_sum(&input, "csv", &out, &flags)
    };
    let r = restore(&[]);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    let e = stderr(&r);
    assert!(
        e.contains(&format!("after checkpoint {older_id}")) && e.contains("--allow-fallback"),
        "{e}"
    );
    assert!(!e.contains("panicked"), "{e}");
    assert_eq!(committed_lines(&out), before, "nothing changed");
    assert_eq!(parse_sums(&before), running_sums(&recs));
    // The newest one restores (a finished job: nothing to replay).
    let newest = job.join(format!("chk-{}", ids.last().expect("one")));
    let flags = [&args[..], &["--restore", newest.to_str().expect("utf8")]].concat();
    let r = keyed_sum(&input, "csv", &out, &flags);
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(committed_lines(&out), before);
    // Allowed, the older one restores and replays what came after it.
    let r = restore(&["--allow-fallback"]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(committed_lines(&out).len() > before.len());
}

/// A job that starts from the beginning replaces earlier runs' part files, with checkpoints
/// too (they stayed, and a second run of the same input left every line twice); a job that
/// restores keeps what its checkpoint committed; a run from the beginning over an earlier
/// run's checkpoints is refused.
#[test]
fn a_checkpointed_run_from_the_beginning_replaces_earlier_output() {
    let Inputs {
        dir: _dir,
        recs,
        input,
        out,
        ck,
    } = Inputs::new(20_000, 29, "csv");
    let ck_s = ck.to_str().expect("utf8");
    let args = ["--checkpoint-dir", ck_s, "--checkpoint-interval", "20ms"];
    // An earlier run without checkpoints, then one with, and another with its own job id.
    let r = keyed_sum(&input, "csv", &out, &[]);
    assert!(r.status.success(), "{}", stderr(&r));
    for extra in [&[][..], &["--job-id", "again"]] {
        let r = keyed_sum(&input, "csv", &out, &[&args[..], extra].concat());
        assert!(r.status.success(), "{}", stderr(&r));
        assert_eq!(parse_sums(&committed_lines(&out)), running_sums(&recs));
    }
    // A run from the beginning that fails as it sets up (an unknown column) leaves the
    // earlier output as it was: it is replaced at the first commit (it was deleted at once).
    let before = committed_lines(&out);
    let other = ck.with_file_name("other-ck");
    let mut bad_key = keyed_sum_args(&input, "csv", &out);
    let k = bad_key.iter().position(|a| *a == "user").expect("--key");
    bad_key[k] = "nope";
    bad_key.extend(["--checkpoint-dir", other.to_str().expect("utf8")]);
    let r = weir(&bad_key);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(stderr(&r).contains("nope"), "{}", stderr(&r));
    assert_eq!(committed_lines(&out), before);
    // A run from the beginning over a job directory with an earlier run's checkpoints is
    // refused before it touches the output: killed before its own first checkpoint, a
    // `--restore latest` would take the earlier run's, whose output it had replaced.
    let before = committed_lines(&out);
    let r = keyed_sum(&input, "csv", &out, &args);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    let e = stderr(&r);
    assert!(
        e.contains("checkpoints of an earlier run") && e.contains("--restore latest"),
        "{e}"
    );
    assert_eq!(committed_lines(&out), before);
    // `--restore latest` over the finished job that wrote the output restores its final
    // checkpoint: nothing is replayed and nothing replaced.
    let r = keyed_sum(
        &input,
        "csv",
        &out,
        &[&args[..], &["--job-id", "again", "--restore", "latest"]].concat(),
    );
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(parse_sums(&committed_lines(&out)), running_sums(&recs));
    // Over a checkpoint directory without checkpoints it starts from the beginning, and
    // replaces.
    let empty = ck.with_file_name("empty-ck");
    let r = keyed_sum(
        &input,
        "csv",
        &out,
        &[
            "--checkpoint-dir",
            empty.to_str().expect("utf8"),
            "--restore",
            "latest",
        ],
    );
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(
        stderr(&r).contains("starting from the beginning"),
        "{}",
        stderr(&r)
    );
    assert_eq!(parse_sums(&committed_lines(&out)), running_sums(&recs));
}

/// A path the job uses in its checkpoint directory `DIR/<job-id>` is refused before anything
/// is written: retention deletes checkpoint directories with what is in them. Before,
/// `--output DIR/keyed-sum/chk-1` lost its committed output when checkpoint 2 completed, and
/// the job failed on its next commit. Beside the job's directory, in `DIR`, is fine.
#[test]
fn paths_in_the_jobs_checkpoint_directory_are_refused() {
    let inputs = Inputs::new(3_000, 20, "csv");
    let (input, ck) = (&inputs.input, &inputs.ck);
    let job_dir = ck.join("keyed-sum");
    let s = |p: &Path| p.to_str().expect("utf8").to_owned();
    let ck_s = s(ck);
    let elsewhere = inputs.dir.path().join("out");
    let chk1 = job_dir.join("chk-1");
    let dl = format!("dead-letter={}", job_dir.join("dl.jsonl").display());
    for (flag, output, extra) in [
        ("--output", &chk1, vec![]),
        ("--output", &job_dir, vec![]),
        (
            "--state-dir",
            &elsewhere,
            vec!["--state-dir".into(), s(&job_dir.join("s"))],
        ),
        (
            "--savepoint-dir",
            &elsewhere,
            vec!["--savepoint-dir".into(), s(&job_dir)],
        ),
        (
            "--on-error dead-letter=",
            &elsewhere,
            vec!["--on-error".into(), dl.clone()],
        ),
    ] {
        let mut args = vec!["--checkpoint-dir", &ck_s, "--checkpoint-interval", "10ms"];
        args.extend(extra.iter().map(String::as_str));
        let r = keyed_sum(input, "csv", output, &args);
        assert_eq!(r.status.code(), Some(1), "{flag}: {}", stderr(&r));
        assert!(
            stderr(&r).contains(flag)
                && stderr(&r).contains(&format!(
                    "is in the job's checkpoint directory {}",
                    job_dir.display()
                )),
            "{}",
            stderr(&r)
        );
        assert!(!job_dir.exists() && !elsewhere.exists(), "nothing written");
    }
    // Beside the job's directory, in the checkpoint directory.
    let beside = ck.join("out");
    let r = keyed_sum(input, "csv", &beside, &["--checkpoint-dir", &ck_s]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert_same_sums(
        &parse_sums(&committed_lines(&beside)),
        &running_sums(&inputs.recs),
        "output beside the job's checkpoints",
    );
}

/// A savepoint goes nowhere retention deletes: `--to` in the job's directory (or a checkpoint's)
/// is refused, exit 1, and nothing is made there. Before, one in `chk-1` stopped the job's
/// retention from removing `chk-1` and `clean` then failed on it. A savepoint made into the
/// checkpoint directory itself sits beside the jobs and is no job: `list`, `clean`, `inspect`
/// and `savepoint` of the directory still see the one job (before, `clean` locked the
/// savepoint as a job, leaving a LOCK file in it, and `inspect`/`savepoint` refused a
/// directory of two jobs), and `list` or `clean` of the savepoint itself say what it is.
#[test]
fn savepoints_stay_out_of_the_jobs_directory_and_are_no_job_beside_it() {
    let inputs = Inputs::new(2_000, 20, "jsonl");
    inputs.run_checkpointed();
    let s = |p: &Path| p.to_str().expect("utf8").to_owned();
    let (ck, job_dir) = (s(&inputs.ck), inputs.ck.join("keyed-sum"));
    for to in [job_dir.clone(), job_dir.join("chk-1")] {
        let r = weir(&["checkpoints", "savepoint", &ck, "--to", &s(&to)]);
        assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
        assert!(
            stderr(&r).contains("is in the job's checkpoint directory"),
            "{}",
            stderr(&r)
        );
        let made = std::fs::read_dir(&to)
            .expect("dir")
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("savepoint-"));
        assert!(!made, "nothing made in {}", to.display());
    }
    let r = weir(&["checkpoints", "savepoint", &ck, "--to", &ck]);
    assert!(r.status.success(), "{}", stderr(&r));
    let sp = String::from_utf8_lossy(&r.stdout).trim().to_string();
    for cmd in [&["list"][..], &["clean"], &["inspect"]] {
        let mut args = vec!["checkpoints"];
        args.extend_from_slice(cmd);
        args.push(&ck);
        let r = weir(&args);
        assert!(r.status.success(), "{cmd:?}: {}", stderr(&r));
        let out = String::from_utf8_lossy(&r.stdout);
        assert!(
            !out.contains("savepoint-"),
            "{cmd:?} took the savepoint for a job: {out}"
        );
    }
    assert!(
        !Path::new(&sp).join("LOCK").exists(),
        "clean left the savepoint alone"
    );
    let again = weir(&[
        "checkpoints",
        "savepoint",
        &ck,
        "--to",
        &s(&inputs.dir.path().join("sps")),
    ]);
    assert!(again.status.success(), "{}", stderr(&again));
    for cmd in ["list", "clean"] {
        let r = weir(&["checkpoints", cmd, &sp]);
        assert_eq!(r.status.code(), Some(1), "{cmd}: {}", stderr(&r));
        assert!(
            stderr(&r).contains("a savepoint, not a job's"),
            "{}",
            stderr(&r)
        );
    }
    let v = weir(&["checkpoints", "verify", &sp]);
    assert!(v.status.success(), "{}", stderr(&v));
}

/// One job per exactly-once output directory: a restore deletes the hidden part files of its
/// shard indices that its checkpoint does not list, which would be another job's. A run whose
/// `--output` another job writes (here: its lock held by this test) exits 1 naming the lock
/// file, having written nothing there; once the directory is free the same command runs.
/// Before, a second job in one output directory failed the first with "File exists" on a
/// part file and both went on writing their shards' parts into it.
#[test]
fn an_output_directory_another_job_writes_is_refused() {
    let run = CheckpointedRun::new(2_000, 50, "2", "20ms");
    std::fs::create_dir_all(&run.out).expect("mkdir");
    let lock_file = run.out.join(weir_runtime::sink::SINK_LOCK_FILE);
    let lock = weir_io::DirLock::acquire_named(&run.out, weir_runtime::sink::SINK_LOCK_FILE)
        .expect("lock");
    let r = weir(&run.args());
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(
        stderr(&r).contains("in use by another job")
            && stderr(&r).contains(&lock_file.display().to_string()),
        "{}",
        stderr(&r)
    );
    let names: Vec<String> = std::fs::read_dir(&run.out)
        .expect("output dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [weir_runtime::sink::SINK_LOCK_FILE],
        "nothing written"
    );
    drop(lock);
    let r = weir(&run.args());
    assert!(r.status.success(), "{}", stderr(&r));
    assert_same_sums(
        &parse_sums(&committed_lines(&run.out)),
        &running_sums(&run.recs),
        "once the directory is free",
    );
}

/// Checkpoint flags that need another flag, or values the job would refuse only once started,
/// are usage errors (exit 2) naming the flag. Before, `--checkpoint-interval 5s` without
/// `--checkpoint-dir` and `--unaligned` with `--mode at-least-once` were ignored without a
/// word (exit 0); `--shards 0` and `--checkpoint-interval 200y` were exit 1 from the job's
/// configuration check, and `--keys 0` was taken as 1; a `--job-id` the checkpoint directory
/// cannot take was exit 1 from the job's checkpoint storage. `--aligned-timeout` without
/// `--unaligned` has no effect (as in Flink): the run goes on and says so.
#[test]
fn flags_without_what_they_need_or_out_of_range_are_usage_errors() {
    let dir = tempfile::tempdir().expect("tmp");
    let input = dir.path().join("in.csv");
    std::fs::write(&input, "user,amount\na,1\n").expect("write");
    let (out, ck) = (dir.path().join("out"), dir.path().join("ck"));
    let ck_s = ck.to_str().expect("utf8");
    let cases: [(&[&str], &str); 14] = [
        (&["--checkpoint-interval", "5s"], "--checkpoint-dir"),
        // A negative value is the flag's bad value, named so (it was "unexpected argument
        // '-1'", which named no flag).
        (
            &["--checkpoint-dir", ck_s, "--aligned-timeout", "-1"],
            "--aligned-timeout",
        ),
        (
            &["--checkpoint-dir", ck_s, "--checkpoint-interval", "-1s"],
            "--checkpoint-interval",
        ),
        (&["--shards", "-2"], "--shards"),
        (&["--checkpoint-dir", ck_s, "--job-id", "../up"], "--job-id"),
        (&["--mode", "at-least-once"], "--checkpoint-dir"),
        (&["--unaligned"], "--checkpoint-dir"),
        (&["--job-id", "j"], "--checkpoint-dir"),
        (&["--savepoint-dir", ck_s], "--checkpoint-dir"),
        (
            &[
                "--checkpoint-dir",
                ck_s,
                "--unaligned",
                "--mode",
                "at-least-once",
            ],
            "--unaligned needs --mode exactly-once",
        ),
        (
            &["--checkpoint-dir", ck_s, "--checkpoint-interval", "200y"],
            "longest duration",
        ),
        (&["--shards", "0"], "--shards"),
        (&["--shards", "1025"], "--shards"),
        (&["--shards", "129"], "1..=128"),
    ];
    for (flags, says) in cases {
        let r = keyed_sum(&input, "csv", &out, flags);
        assert_eq!(r.status.code(), Some(2), "{flags:?}: {}", stderr(&r));
        assert!(stderr(&r).contains(says), "{flags:?}: {}", stderr(&r));
        // One line, as every other error (clap's usage and hint lines are left out).
        assert_eq!(
            stderr(&r).trim_end().lines().count(),
            1,
            "{flags:?}: {}",
            stderr(&r)
        );
        assert!(!out.exists() && !ck.exists(), "{flags:?}: nothing written");
    }
    let r = keyed_sum(
        &input,
        "csv",
        &out,
        &["--checkpoint-dir", ck_s, "--aligned-timeout", "5ms"],
    );
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(
        stderr(&r).contains("--aligned-timeout has no effect without --unaligned"),
        "{}",
        stderr(&r)
    );
    for flags in [["--keys", "0"], ["--shards", "0"]] {
        let mut args = vec!["run", "demo", "--events", "1000"];
        args.extend(flags);
        let r = weir(&args);
        assert_eq!(r.status.code(), Some(2), "{flags:?}: {}", stderr(&r));
        assert!(stderr(&r).contains(flags[0]), "{flags:?}: {}", stderr(&r));
        assert!(!stderr(&r).contains("bids over"), "{}", stderr(&r));
    }
}

/// The complete checkpoints `list --json` shows under `ck`: (job, id, size, new bytes).
fn complete_checkpoints(ck: &Path) -> Vec<(String, u64, u64, u64)> {
    let r = weir(&["checkpoints", "list", ck.to_str().expect("utf8"), "--json"]);
    assert!(r.status.success(), "{}", stderr(&r));
    String::from_utf8_lossy(&r.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json"))
        .filter(|v| v["status"] == "complete")
        .map(|v| {
            let n = |k: &str| v[k].as_u64().expect(k);
            let job = v["job"].as_str().expect("job").to_string();
            (job, n("checkpoint"), n("size_bytes"), n("new_bytes"))
        })
        .collect()
}

/// `--checkpoint-config FILE` takes every checkpoint and restart setting from TOML: its `dir`
/// stands for `--checkpoint-dir`, flags given beside it override its values, and `--restore
/// latest` finds the checkpoints where it put them. A mistake in it is a usage error (exit
/// 2) naming the file, the key and its line, before anything is written. (Before, timeout,
/// min pause, tolerable failures, incremental and the restart strategy could not be set
/// from `weir run`, and `incremental = false` was ignored by the runtime.)
#[test]
fn a_checkpoint_config_file_sets_what_the_flags_do_not() {
    let dir = tempfile::tempdir().expect("tmp");
    let input = dir.path().join("in.csv");
    let recs = records(200_000, 300);
    write_csv(&input, &recs);
    let want = running_sums(&recs);
    let ck = dir.path().join("ck");
    let cfg = dir.path().join("ck.toml");
    let cfg_s = cfg.to_str().expect("utf8");
    std::fs::write(
        &cfg,
        format!(
            "dir = '{}'\njob-id = \"sums\"\ninterval = \"1h\"\nretained = 2\n\
             incremental = false\ntolerable-failures = 1\ntimeout = \"1m\"\n\
             [restart]\nstrategy = \"fixed-delay\"\nattempts = 3\ndelay = \"10ms\"\n",
            ck.display()
        ),
    )
    .expect("write");
    // The file alone: its job id, and its interval of an hour leaves only the final
    // checkpoint.
    let out = dir.path().join("out");
    let r = keyed_sum(&input, "csv", &out, &["--checkpoint-config", cfg_s]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(parse_sums(&committed_lines(&out)), want);
    assert!(!ck.join("keyed-sum").exists(), "the file's job id");
    let kept = complete_checkpoints(&ck);
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].0, "sums");
    // `--restore latest` restores from the file's directory: the finished job replays
    // nothing.
    let r = keyed_sum(
        &input,
        "csv",
        &out,
        &["--checkpoint-config", cfg_s, "--restore", "latest"],
    );
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(
        stderr(&r).contains(&format!("restoring from checkpoint {}", kept[0].1)),
        "{}",
        stderr(&r)
    );
    assert_eq!(parse_sums(&committed_lines(&out)), want);
    // A flag overrides the file: checkpoints every 5 ms, of which the file's two are kept,
    // each a full one (it wrote all it holds).
    std::fs::remove_dir_all(&ck).expect("rm");
    let out2 = dir.path().join("out2");
    let r = keyed_sum(
        &input,
        "csv",
        &out2,
        &[
            "--checkpoint-config",
            cfg_s,
            "--checkpoint-interval",
            "5ms",
            "--shards",
            "1",
        ],
    );
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(parse_sums(&committed_lines(&out2)), want);
    // The two newest of those the run completed (how many depends on the machine's speed:
    // at least a periodic one and the final one).
    let completed: u64 = stderr(&r)
        .split("checkpoints: ")
        .nth(1)
        .and_then(|t| t.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("a checkpoint summary: {}", stderr(&r)));
    assert!(completed >= 2, "{}", stderr(&r));
    // The same counts under Flink's metric names, and the newest checkpoint's own figures.
    let e = stderr(&r);
    for name in [
        format!("numberOfCompletedCheckpoints={completed} "),
        "numberOfFailedCheckpoints=".into(),
        "numberOfInProgressCheckpoints=0 ".into(),
        "lastCheckpointDuration=".into(),
        "lastCheckpointSize=".into(),
        "lastCheckpointFullSize=".into(),
        "lastCheckpointRestoreTimestamp=-1".into(),
        "triggerTimestamp=".into(),
        "syncDuration=".into(),
        "asyncDuration=".into(),
        "alignmentDuration=".into(),
        "startDelay=".into(),
        "persistedInFlightBytes=".into(),
        "acknowledged=0:".into(),
    ] {
        assert!(e.contains(&name), "{name}: {e}");
    }
    let kept = complete_checkpoints(&ck);
    let ids: Vec<u64> = kept.iter().map(|k| k.1).collect();
    // (Ids go past the count by the failed ones: the file tolerates one.)
    assert!(
        ids.len() == 2 && ids[0] >= completed - 1 && ids[0] < ids[1],
        "{kept:?} of {completed}"
    );
    for (_, id, size, new) in &kept {
        // Framed copies: their frames come on top of what they hold.
        assert!(new >= size, "checkpoint {id} is a full one: {kept:?}");
    }
    // Mistakes, each naming the file and where.
    let bad = dir.path().join("bad.toml");
    let bad_s = bad.to_str().expect("utf8");
    let ck_s = ck.to_str().expect("utf8");
    let out3 = dir.path().join("out3");
    let cases: [(&str, &[&str], &[&str]); 7] = [
        (
            "dir = 'x'\njob-id = '../up'\n",
            &[],
            &["bad.toml", "`job-id` at line 2", "[A-Za-z0-9._-]"],
        ),
        (
            "dir = 'x'\nintervall = \"1s\"\n",
            &[],
            &["bad.toml", "`intervall` at line 2", "unknown field"],
        ),
        (
            "dir = 'x'\n# keep\nretained = 0\n",
            &[],
            &["bad.toml", "`retained` at line 3", "at least 1"],
        ),
        (
            "dir = 'x'\n[restart]\nstrategy = \"exponential-delay\"\nattempts = 3\n",
            &[],
            &["`restart.attempts` at line 4", "takes no `attempts`"],
        ),
        (
            "interval = \"1s\"\n",
            &[],
            &["bad.toml", "sets no `dir`", "--checkpoint-dir"],
        ),
        (
            "mode = \"at-least-once\"\n",
            &["--checkpoint-dir", ck_s, "--unaligned"],
            &["bad.toml", "need mode exactly-once"],
        ),
        (
            "timeout = \"soon\"\n",
            &["--checkpoint-dir", ck_s],
            &["`timeout` at line 1", "`soon`"],
        ),
    ];
    for (text, flags, says) in cases {
        std::fs::write(&bad, text).expect("write");
        let mut args = vec!["--checkpoint-config", bad_s];
        args.extend(flags);
        let r = keyed_sum(&input, "csv", &out3, &args);
        assert_eq!(r.status.code(), Some(2), "{text}: {}", stderr(&r));
        for s in says {
            assert!(stderr(&r).contains(s), "{text}: {s}: {}", stderr(&r));
        }
        assert!(!out3.exists(), "{text}: nothing written");
    }
    let missing = dir.path().join("missing.toml");
    let r = keyed_sum(
        &input,
        "csv",
        &out3,
        &["--checkpoint-config", missing.to_str().expect("utf8")],
    );
    assert_eq!(r.status.code(), Some(2), "{}", stderr(&r));
    assert!(stderr(&r).contains("missing.toml"), "{}", stderr(&r));
}

/// `weir checkpoints` given `.` or `..` (a job or `chk-<n>` directory reached by `cd`). Before,
/// a job directory so given was "not a job directory" (exit 1) and a sound `chk-<n>`
/// directory, read as a savepoint, "misdirected block" (exit 3).
#[test]
fn checkpoints_commands_take_dot_and_dot_dot() {
    let inputs = Inputs::new(1000, 7, "jsonl");
    inputs.run_checkpointed();
    let job = inputs.ck.join("keyed-sum");
    let id = newest_complete_id(&job).expect("a checkpoint");
    let chk = job.join(format!("chk-{id}"));
    let in_dir = |cwd: &Path, args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(args)
            .current_dir(cwd)
            .output()
            .expect("weir runs")
    };
    let ok = format!("ok keyed-sum checkpoint {id}");
    let chk_name = format!("../chk-{id}");
    for (cwd, args, says) in [
        (&job, &["checkpoints", "list", "."][..], "keyed-sum"),
        (&job, &["checkpoints", "verify", "."], ok.as_str()),
        (&chk, &["checkpoints", "verify", "."], ok.as_str()),
        (
            &chk,
            &["checkpoints", "verify", chk_name.as_str()],
            ok.as_str(),
        ),
        (&chk, &["checkpoints", "list", ".."], "keyed-sum"),
        (&chk, &["checkpoints", "inspect", "."], "job keyed-sum"),
    ] {
        let r = in_dir(cwd, args);
        assert_eq!(r.status.code(), Some(0), "{args:?}: {}", stderr(&r));
        let stdout = String::from_utf8_lossy(&r.stdout);
        assert!(stdout.contains(says), "{args:?}: {stdout}");
    }
}

/// An empty `--restore` is a usage error, and a `--savepoint-dir` that is a file is refused
/// before the job starts. Before, the first failed as "restore: : checkpoint 0 not found"
/// and the second was found only when a stop signal's savepoint failed, the job going on.
#[test]
fn an_empty_restore_or_a_savepoint_dir_that_is_a_file_is_refused_at_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let input = dir.path().join("in.csv");
    std::fs::write(&input, "user,amount\na,1\n").expect("write");
    let (out, ck) = (dir.path().join("out"), dir.path().join("ck"));
    let ck_s = ck.to_str().expect("utf8");
    let r = keyed_sum(
        &input,
        "csv",
        &out,
        &["--checkpoint-dir", ck_s, "--restore", ""],
    );
    assert_eq!(r.status.code(), Some(2), "{}", stderr(&r));
    assert!(stderr(&r).contains("--restore"), "{}", stderr(&r));
    let file = input.to_str().expect("utf8");
    let flags = ["--checkpoint-dir", ck_s, "--savepoint-dir", file];
    let r = keyed_sum(&input, "csv", &out, &flags);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(
        stderr(&r).contains(&format!(
            "--savepoint-dir {file}: exists and is not a directory"
        )),
        "{}",
        stderr(&r)
    );
    assert!(!out.exists() && !ck.exists(), "nothing written");
    let r = weir(&[
        "run",
        "demo",
        "--events",
        "1000",
        "--checkpoint-dir",
        ck_s,
        "--savepoint-dir",
        file,
    ]);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(stderr(&r).contains("--savepoint-dir"), "{}", stderr(&r));
}

/// `WEIR_FLIP_CASES` (default 6) damaged files, each a seeded random file of the checkpoint
/// directory that a killed unaligned keyed-sum run left (metadata, `COMPLETED`, segments,
/// channel and operator state, merged files; not `LOCK`, which holds a process id for the
/// lock's holder to read): mostly a bit flipped at a random offset, else the file cut there,
/// garbage appended, or the file removed. Each is done to a fresh copy of that directory and
/// of the output, then `verify` runs and a restart with `--restore latest` finishes the job.
/// The damage is caught (verify exits 3, the restart exits 1, both naming the file) or
/// harmless (the restart commits every running sum exactly once); it never passes verify and
/// then stops a restore, never yields a wrong output, and never panics.
#[test]
fn a_damaged_file_anywhere_in_a_checkpoint_is_caught_or_harmless() {
    damage_to_keyed_sum(false);
}

/// The same damage to a savepoint of a killed keyed-sum run's newest checkpoint (a
/// self-contained copy: framed files, its own metadata), with `verify SAVEPOINT` and restarts
/// from `--restore SAVEPOINT`.
#[test]
fn a_damaged_file_in_a_savepoint_is_caught_or_harmless() {
    damage_to_keyed_sum(true);
}

/// The damage tests of a killed keyed-sum run, to its checkpoints or (`savepoint`) to a
/// savepoint of its newest one.
fn damage_to_keyed_sum(savepoint: bool) {
    damage_to_the_checkpoints_of(
        "keyed-sum",
        CheckpointedRun::new(1_200_000, 997, "2", "20ms"),
        savepoint,
        |run, what| {
            let got = parse_sums(&committed_lines(&run.out));
            assert_same_sums(&got, &running_sums(&run.recs), what);
        },
    );
}

/// The same for `weir run window-count` (window state, event-time timers and watermarks in
/// the checkpoint): harmless damage leaves every window's count committed exactly once.
#[test]
fn a_damaged_file_in_a_window_jobs_checkpoint_is_caught_or_harmless() {
    damage_to_the_checkpoints_of(
        "window-count",
        CheckpointedRun::window_count(1_200_000, 997, "2", "20ms", "100ms"),
        false,
        |run, what| {
            let mut got = committed_lines(&run.out);
            got.sort();
            assert!(got == window_counts(&run.recs, 100), "{what}");
        },
    );
}

/// The damage of [`a_damaged_file_anywhere_in_a_checkpoint_is_caught_or_harmless`] to the
/// checkpoints of `run` (of job `job`), killed after its fourth checkpoint; `check` asserts
/// that the committed output of a finished run is exact.
fn damage_to_the_checkpoints_of(
    job: &str,
    mut run: CheckpointedRun,
    savepoint: bool,
    check: impl Fn(&CheckpointedRun, &str),
) {
    let cases: u64 = std::env::var("WEIR_FLIP_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    run.args.push("--unaligned".into());
    let job_dir = run.ck.join(job);
    // A few checkpoints in, so that the newest one holds more than the first (channel
    // state of unaligned barriers, merged files, several segments a shard).
    run.killed_after(job, 4);
    // With `savepoint`, the damage is done to a savepoint of the newest checkpoint, which the
    // restarts restore from (`--restore PATH`) instead of the newest checkpoint.
    let sp_dir = run.dir.path().join("sp");
    let damaged = if savepoint {
        let (chk, _, _) = newest_checkpoint(&job_dir);
        let sp = savepoint_of(&run.ck, &chk, &sp_dir);
        let at = run
            .args
            .iter()
            .position(|a| a == "latest")
            .expect("--restore latest");
        run.args[at] = sp.to_str().expect("utf8").to_owned();
        sp
    } else {
        job_dir.clone()
    };
    let pristine = run.dir.path().join("pristine");
    let trees = [("ckpt", &run.ck), ("out", &run.out), ("sp", &sp_dir)];
    for (name, tree) in trees {
        if tree.exists() {
            copy_tree(tree, &pristine.join(name));
        }
    }
    let mut files = files_under(&damaged);
    files.retain(|f| f.file_name().is_some_and(|n| n != "LOCK"));
    files.sort();
    assert!(files.len() > 2, "{files:?}");
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut caught, mut harmless) = (0u64, 0u64);
    for case in 0..cases {
        for (from, to) in trees {
            if to.exists() {
                std::fs::remove_dir_all(to).expect("remove");
                copy_tree(&pristine.join(from), to);
            }
        }
        let f = &files[(next() % files.len() as u64) as usize];
        let len = std::fs::metadata(f).expect("flipped file").len();
        if len == 0 {
            continue;
        }
        let mut bytes = std::fs::read(f).expect("read");
        let at = next() % len;
        // Mostly flips; also cuts, appended garbage and removals.
        let damage = match next() % 8 {
            0 => {
                bytes.truncate(at as usize);
                format!("cut to {at} bytes")
            }
            1 => {
                let extra = 1 + next() % 64;
                bytes.extend((0..extra).map(|_| next() as u8));
                format!("{extra} bytes appended to")
            }
            2 => "removed".to_string(),
            _ => {
                let bit = next() % 8;
                bytes[at as usize] ^= 1 << bit;
                format!("bit {bit} of byte {at} flipped in")
            }
        };
        if damage == "removed" {
            std::fs::remove_file(f).expect("remove");
        } else {
            std::fs::write(f, bytes).expect("write");
        }
        let name = f.file_name().and_then(|n| n.to_str()).expect("name");
        let what = format!("case {case}: {damage} {}", f.display());
        let verified = if savepoint { &damaged } else { &run.ck };
        let v = weir(&["checkpoints", "verify", verified.to_str().expect("utf8")]);
        let ve = stderr(&v);
        assert!(!ve.contains("panicked"), "{what}: verify: {ve}");
        match v.status.code() {
            Some(0) => {}
            Some(3) => assert!(ve.contains(name), "{what}: verify names the file: {ve}"),
            // A savepoint without its metadata is no savepoint (what a crash while one is
            // written leaves): not a corrupt one, exit 1.
            Some(1) if savepoint && !damaged.join("_metadata").exists() => {
                assert!(ve.contains("_metadata"), "{what}: verify says why: {ve}");
            }
            c => panic!("{what}: verify exit {c:?}: {ve}"),
        }
        let o = weir_within(&run.args(), 120);
        let oe = stderr(&o);
        assert!(!oe.contains("panicked"), "{what}: restart: {oe}");
        match o.status.code() {
            Some(0) => {
                check(&run, &what);
                harmless += 1;
            }
            Some(1) => {
                assert_ne!(
                    v.status.code(),
                    Some(0),
                    "{what}: the restart refused a checkpoint that verify passed: {oe}"
                );
                assert!(
                    oe.contains(name),
                    "{what}: the restart names the file: {oe}"
                );
                caught += 1;
            }
            c => panic!("{what}: restart exit {c:?}: {oe}"),
        }
    }
    eprintln!(
        "{job}: {cases} damaged files of {}: {caught} caught, {harmless} harmless",
        files.len()
    );
}

/// Every regular file under `dir`, at any depth.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("read dir").flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A copy of the tree at `from` as `to` (which must not exist): directories and file
/// contents, each file a new one (never a link to the original).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create dir");
    for e in std::fs::read_dir(from).expect("read dir").flatten() {
        let (p, q) = (e.path(), to.join(e.file_name()));
        if p.is_dir() {
            copy_tree(&p, &q);
        } else {
            std::fs::copy(&p, &q).expect("copy");
        }
    }
}

/// An input file changed before the offset a checkpoint read it to (here one digit of an early
/// line, every line where it was) is refused by a restart with `--restore latest`, naming the
/// file and the change, rather than read on from the old offset into other content; nothing
/// from after the checkpoint is committed.
#[test]
fn a_restart_refuses_an_input_changed_before_the_checkpointed_offset() {
    let run = CheckpointedRun::new(1_200_000, 997, "1", "20ms");
    run.killed_after("keyed-sum", 2);
    let committed = committed_lines(&run.out).len();
    let input = run.dir.path().join("in.csv");
    let mut text = std::fs::read(&input).expect("input");
    // The last digit of the header's next line: the first record's amount.
    let at = text.iter().position(|&b| b == b'\n').expect("a header") + 1;
    let end = at
        + text[at..]
            .iter()
            .position(|&b| b == b'\n')
            .expect("a record");
    text[end - 1] = if text[end - 1] == b'7' { b'8' } else { b'7' };
    std::fs::write(&input, text).expect("change the input");
    let o = weir(&run.args());
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("in.csv") && e.contains("the file changed since"),
        "names the file and the change: {e}"
    );
    // The restart may have published the restored checkpoint's pending files (its second
    // phase), and nothing else: each key's committed sums are a prefix of its running sums.
    let got = parse_sums(&committed_lines(&run.out));
    let want = running_sums(&run.recs);
    assert!(committed_lines(&run.out).len() >= committed);
    for (k, sums) in &got {
        assert!(
            want[k].starts_with(sums),
            "key {k}: its running sums up to the checkpoint"
        );
    }
}

/// Relative paths throughout (from the working directory): the run records the absolute
/// path of the checkpoint it restored, and `--restore latest` continues from it.
#[test]
fn restore_latest_with_relative_directories() {
    let dir = tempfile::tempdir().expect("tmp");
    let recs: Vec<(String, i64, i64)> = (0..20_000i64)
        .map(|i| (format!("u{}", i % 37), i % 11, i))
        .collect();
    write_csv(&dir.path().join("in.csv"), &recs);
    let args = keyed_sum_args(Path::new("in.csv"), "csv", Path::new("out"));
    let run = |extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(&args)
            .args(["--checkpoint-dir", "ck", "--checkpoint-interval", "10ms"])
            .args(extra)
            .current_dir(dir.path())
            .output()
            .expect("weir runs");
        assert!(o.status.success(), "{}", stderr(&o));
        o
    };
    run(&[]);
    let o = run(&["--restore", "latest"]);
    assert!(
        stderr(&o).contains("restoring from checkpoint"),
        "{}",
        stderr(&o)
    );
    let o = run(&["--restore", "latest"]);
    assert!(
        stderr(&o).contains("restoring from checkpoint"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        parse_sums(&committed_lines(&dir.path().join("out"))),
        running_sums(&recs)
    );
}

/// Runs keyed-sum over `inputs` as job `job` in `inputs.ck`, keeping several checkpoints:
/// the job's directory and the ids of its checkpoints with metadata, oldest first.
fn job_keeping_checkpoints(inputs: &Inputs, job: &str) -> (PathBuf, Vec<u64>) {
    let ck_s = inputs.ck.to_str().expect("utf8");
    let out = inputs.dir.path().join(format!("out-{job}"));
    let mut flags = keeping_checkpoints(ck_s).to_vec();
    flags.extend(["--job-id", job]);
    let r = keyed_sum(&inputs.input, "csv", &out, &flags);
    assert!(r.status.success(), "{}", stderr(&r));
    kept_checkpoints_of(&inputs.ck, job)
}

/// A refused `savepoint` leaves nothing behind: `--to` in the job's directory (spelt with a
/// `..` past a directory that does not exist too) or of a checkpoint that is not there made
/// `--to` and the directories above it before the export refused it, so a savepoint
/// directory with nothing in it sat where retention deletes. One that succeeds makes `--to`.
#[test]
fn a_refused_savepoint_makes_no_directory() {
    let inputs = Inputs::new(2_000, 20, "jsonl");
    inputs.run_checkpointed();
    let s = |p: &Path| p.to_str().expect("utf8").to_owned();
    let (ck, job_dir) = (s(&inputs.ck), inputs.ck.join("keyed-sum"));
    let x = inputs.ck.join("x");
    for (to, made) in [
        (job_dir.join("sp"), job_dir.join("sp")),
        (job_dir.join("a/b"), job_dir.join("a")),
        (x.join("../keyed-sum/sp2"), x.clone()),
        (x.join("../keyed-sum/sp3"), job_dir.join("sp3")),
    ] {
        let r = weir(&["checkpoints", "savepoint", &ck, "--to", &s(&to)]);
        assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
        assert!(
            stderr(&r).contains("is in the job's checkpoint directory"),
            "{}",
            stderr(&r)
        );
        assert!(
            !made.exists(),
            "{} made for {}",
            made.display(),
            to.display()
        );
    }
    let elsewhere = inputs.dir.path().join("new");
    let r = weir(&[
        "checkpoints",
        "savepoint",
        &ck,
        "--checkpoint",
        "999",
        "--to",
        &s(&elsewhere.join("deeper")),
    ]);
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(
        !elsewhere.exists(),
        "nothing made for a checkpoint not there"
    );
    let r = weir(&[
        "checkpoints",
        "savepoint",
        &ck,
        "--to",
        &s(&elsewhere.join("deeper")),
    ]);
    assert!(r.status.success(), "{}", stderr(&r));
    let sp = PathBuf::from(String::from_utf8_lossy(&r.stdout).trim());
    assert!(sp.starts_with(elsewhere.join("deeper")) && sp.join("_metadata").is_file());
}

/// `clean` of a job whose `RUN_ORIGIN` does not decode deletes nothing of it: which checkpoint
/// a restore from `latest` continues is unknown (`verify` says to restore one by its path),
/// and retention keeps the one the record names. It exits 3 naming the file and the offset,
/// and still cleans the other jobs. Before, it exited 0 and dropped all but the newest.
#[test]
fn clean_refuses_a_job_whose_run_origin_does_not_decode() {
    let inputs = Inputs::new(200_000, 41, "csv");
    let (a, a_ids) = job_keeping_checkpoints(&inputs, "a");
    let (b, b_ids) = job_keeping_checkpoints(&inputs, "b");
    let origin = a.join(weir_io::RUN_ORIGIN_FILE);
    let mut bytes = std::fs::read(&origin).expect("the run recorded where it started");
    let crc = bytes.iter().position(|&c| c == b'\n').expect("a line") - 1;
    bytes[crc] ^= 0x01;
    std::fs::write(&origin, &bytes).expect("write");
    let sorted = |d: &Path| {
        let mut v = files_under(d);
        v.sort();
        v
    };
    let before = sorted(&a);
    let ck_s = inputs.ck.to_str().expect("utf8");
    let r = weir(&["checkpoints", "clean", ck_s, "--keep", "1"]);
    let e = stderr(&r);
    assert_eq!(r.status.code(), Some(3), "{e}");
    assert!(
        e.contains(origin.to_str().expect("utf8")) && e.contains("offset"),
        "{e}"
    );
    assert_eq!(sorted(&a), before, "nothing of the job deleted");
    for id in &a_ids {
        assert!(a.join(format!("chk-{id}/_metadata")).is_file(), "{id}");
    }
    let out = String::from_utf8_lossy(&r.stdout);
    let newest = b_ids.last().expect("one");
    assert!(
        out.contains(&format!("b: kept [{newest}]")) && !out.contains("a: kept"),
        "{out}"
    );
    assert!(!b.join(format!("chk-{}/_metadata", b_ids[0])).exists());
}

/// `inspect` and `savepoint` without `--checkpoint`, when the checkpoint `COMPLETED` names
/// lost its `_metadata` (or its whole directory): corrupt (exit 3), as `verify` and a restore
/// take it, and as a corrupt `_metadata` already was. Before, they fell back to the
/// checkpoint before it, exit 0. An older checkpoint named by `--checkpoint` is still read.
#[test]
fn inspect_and_savepoint_stop_at_a_completed_checkpoint_that_lost_its_metadata() {
    let inputs = Inputs::new(200_000, 41, "csv");
    let (job, ids) = job_keeping_checkpoints(&inputs, "keyed-sum");
    let newest = *ids.last().expect("one");
    let chk = job.join(format!("chk-{newest}"));
    let older = ids[ids.len() - 2].to_string();
    let ck_s = inputs.ck.to_str().expect("utf8");
    let sp = inputs.dir.path().join("sp");
    let sp_s = sp.to_str().expect("utf8");
    std::fs::remove_file(chk.join("_metadata")).expect("rm");
    for removed in ["metadata", "directory"] {
        if removed == "directory" {
            std::fs::remove_dir_all(&chk).expect("rm");
        }
        for args in [
            vec!["checkpoints", "inspect", ck_s],
            vec!["checkpoints", "inspect", ck_s, "--json"],
            vec!["checkpoints", "savepoint", ck_s, "--to", sp_s],
        ] {
            let r = weir(&args);
            let e = stderr(&r);
            assert_eq!(r.status.code(), Some(3), "{removed}: {args:?}: {e}");
            assert!(
                e.contains("COMPLETED") && e.contains(&format!("chk-{newest}/_metadata")),
                "{removed}: {args:?}: {e}"
            );
            assert!(r.stdout.is_empty(), "{args:?}");
        }
        assert!(!sp.exists(), "no savepoint directory made");
        let r = weir(&["checkpoints", "inspect", ck_s, "--checkpoint", &older]);
        assert!(r.status.success(), "{}", stderr(&r));
    }
}

/// A directory whose name is no job id (weir refuses such an id) beside a job is passed
/// over, with a note naming it: it failed `list`, `verify` and `clean` of the whole directory
/// ("invalid job id", exit 1), and the real job was never listed, verified or cleaned.
#[test]
fn a_directory_whose_name_is_no_job_id_is_skipped() {
    let inputs = Inputs::new(2_000, 20, "jsonl");
    inputs.run_checkpointed();
    let odd = inputs.ck.join("jöb");
    for d in ["shared", "taskowned"] {
        std::fs::create_dir_all(odd.join(d)).expect("mkdir");
    }
    let ck_s = inputs.ck.to_str().expect("utf8");
    for (cmd, says) in [
        ("list", "keyed-sum"),
        ("verify", "ok keyed-sum checkpoint"),
        ("clean", "keyed-sum: kept ["),
    ] {
        let r = weir(&["checkpoints", cmd, ck_s]);
        let e = stderr(&r);
        assert!(r.status.success(), "{cmd}: {e}");
        assert!(
            String::from_utf8_lossy(&r.stdout).contains(says),
            "{cmd}: {}",
            String::from_utf8_lossy(&r.stdout)
        );
        assert!(
            e.contains(odd.to_str().expect("utf8")) && e.contains("skipped"),
            "{cmd}: {e}"
        );
        assert!(!e.contains("error"), "{cmd}: {e}");
    }
    assert!(!odd.join("LOCK").exists(), "clean left it alone");
}

/// `verify --checkpoint N` of a directory of jobs checks N in every job: a job without N is
/// reported as such, the others' N are still verified, and the exit code says what failed
/// (1 for a job lacking N, 3 if any N is corrupt). Before, it stopped at the first job
/// lacking N (exit 1), and never verified the others'.
#[test]
fn verify_of_one_checkpoint_checks_every_job() {
    let inputs = Inputs::new(200_000, 41, "csv");
    let (a, a_ids) = job_keeping_checkpoints(&inputs, "a");
    let (b, b_ids) = job_keeping_checkpoints(&inputs, "b");
    // A checkpoint of `b` that `a` lacks (not `a`'s newest, whose loss would be corruption).
    let newest_a = *a_ids.last().expect("one");
    let n = *b_ids.iter().find(|&&n| n != newest_a).expect("an id");
    let a_chk = a.join(format!("chk-{n}"));
    if a_chk.exists() {
        std::fs::remove_dir_all(&a_chk).expect("rm");
    }
    let ck_s = inputs.ck.to_str().expect("utf8");
    let n_s = n.to_string();
    let r = weir(&["checkpoints", "verify", ck_s, "--checkpoint", &n_s]);
    let (e, o) = (stderr(&r), String::from_utf8_lossy(&r.stdout).to_string());
    assert_eq!(r.status.code(), Some(1), "{e}");
    assert!(o.contains(&format!("ok b checkpoint {n}:")), "{o}");
    assert!(
        e.contains(&format!("error: a: checkpoint {n} has no metadata")),
        "{e}"
    );
    assert!(e.contains("1 job lacks"), "{e}");
    // With `b`'s N corrupt as well: exit 3, naming both.
    let meta = b.join(format!("chk-{n}")).join("_metadata");
    let mut bytes = std::fs::read(&meta).expect("read");
    bytes[40] ^= 0x10;
    std::fs::write(&meta, bytes).expect("write");
    let r = weir(&["checkpoints", "verify", ck_s, "--checkpoint", &n_s]);
    let e = stderr(&r);
    assert_eq!(r.status.code(), Some(3), "{e}");
    assert!(e.contains(meta.to_str().expect("utf8")), "{e}");
    assert!(
        e.contains(&format!("error: a: checkpoint {n} has no metadata")),
        "{e}"
    );
}

/// `list` of a job whose `COMPLETED` record does not decode and whose checkpoints have no
/// metadata left (what `verify` reports as corruption, exit 3): its table as before, and a
/// note on stderr naming the record and the offset. Before, it printed its header alone and
/// said nothing. It exits 0: `list` shows what is there, and judging it is `verify`'s.
#[test]
fn list_notes_a_damaged_completed_record_with_no_metadata_left() {
    let inputs = Inputs::new(2_000, 20, "jsonl");
    inputs.run_checkpointed();
    let job = inputs.ck.join("keyed-sum");
    let record = job.join("COMPLETED");
    std::fs::write(&record, b"garbage\n").expect("write");
    for e in std::fs::read_dir(&job).expect("job dir").flatten() {
        let meta = e.path().join("_metadata");
        if meta.exists() {
            std::fs::remove_file(meta).expect("rm");
        }
    }
    let ck_s = inputs.ck.to_str().expect("utf8");
    let v = weir(&["checkpoints", "verify", ck_s]);
    assert_eq!(v.status.code(), Some(3), "{}", stderr(&v));
    let r = weir(&["checkpoints", "list", ck_s]);
    let e = stderr(&r);
    assert!(r.status.success(), "{e}");
    assert!(
        e.contains(record.to_str().expect("utf8")) && e.contains("offset"),
        "{e}"
    );
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(out.starts_with("job "), "the table as before: {out}");
    assert!(
        out.lines().skip(1).all(|l| l.contains("incomplete")),
        "{out}"
    );
    let r = weir(&["checkpoints", "list", ck_s, "--json"]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(stderr(&r).contains(record.to_str().expect("utf8")));
    for l in String::from_utf8_lossy(&r.stdout).lines() {
        serde_json::from_str::<serde_json::Value>(l).expect("stdout is JSON lines only");
    }
}

/// The `--checkpoint-config` file's durations are whole milliseconds, as the flags' are: a
/// usage error (exit 2) naming the file, the key and its line. Before, `interval = "1us"`,
/// `timeout = "1ns"` and `min-pause = "1ns"` were taken.
#[test]
fn a_checkpoint_config_file_takes_whole_milliseconds_only() {
    let inputs = Inputs::new(100, 5, "csv");
    let cfg = inputs.dir.path().join("ck.toml");
    let cfg_s = cfg.to_str().expect("utf8");
    let ck = inputs.ck.to_str().expect("utf8").to_owned();
    for (key, value) in [
        ("interval", "1us"),
        ("timeout", "1ns"),
        ("min-pause", "1ns"),
    ] {
        std::fs::write(&cfg, format!("dir = {ck:?}\n{key} = \"{value}\"\n")).expect("write");
        let r = keyed_sum(
            &inputs.input,
            "csv",
            &inputs.out,
            &["--checkpoint-config", cfg_s],
        );
        let e = stderr(&r);
        assert_eq!(r.status.code(), Some(2), "{key}: {e}");
        assert!(
            e.contains(cfg_s)
                && e.contains(&format!("`{key}` at line 2"))
                && e.contains("not a whole number of milliseconds"),
            "{e}"
        );
        assert!(!inputs.ck.exists() && !inputs.out.exists(), "nothing ran");
    }
}
