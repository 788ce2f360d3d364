//! A plain (non-transactional) file sink writer: one `part-<shard>.csv` per shard, written
//! through a large buffer and made durable by [`FileSinkWriter::finish`].

use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// Write buffer size: one system call per 64 KiB of output rather than per line.
const WRITE_BUFFER_BYTES: usize = 64 * 1024;

/// Writes lines to one shard's output file.
#[derive(Debug)]
pub struct FileSinkWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

/// Adds the file's path to an I/O error, which otherwise would not say which file failed.
fn with_path(path: &Path) -> impl FnOnce(io::Error) -> io::Error + '_ {
    move |e| io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

impl FileSinkWriter {
    /// Creates `dir` (and parents) and opens `dir/part-<shard>.csv` for writing (truncating an
    /// old one).
    pub fn create(dir: &Path, shard: usize) -> io::Result<Self> {
        fs::create_dir_all(dir).map_err(with_path(dir))?;
        let path = dir.join(format!("part-{shard}.csv"));
        let file = File::create(&path).map_err(with_path(&path))?;
        Ok(Self {
            out: BufWriter::with_capacity(WRITE_BUFFER_BYTES, file),
            path,
        })
    }

    /// Appends one line, as given, followed by '\n'. Buffered: nothing may reach the file
    /// before [`FileSinkWriter::finish`].
    pub fn write_line(&mut self, line: &str) -> io::Result<()> {
        self.out
            .write_all(line.as_bytes())
            .map_err(with_path(&self.path))?;
        self.out.write_all(b"\n").map_err(with_path(&self.path))
    }

    /// Flushes buffered bytes and fsyncs the file, and on Unix also its directory so that a
    /// newly created file's entry survives a crash too.
    pub fn finish(&mut self) -> io::Result<()> {
        self.out.flush().map_err(with_path(&self.path))?;
        self.out
            .get_ref()
            .sync_all()
            .map_err(with_path(&self.path))?;
        #[cfg(unix)]
        if let Some(dir) = self.path.parent() {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(with_path(dir))?;
        }
        Ok(())
    }

    /// The path of the file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn creates_directories_and_writes_lines() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().join("a").join("b");
        let mut w = FileSinkWriter::create(&dir, 3).expect("create");
        assert_eq!(w.path(), dir.join("part-3.csv"));
        w.write_line("k,v").expect("write");
        w.write_line("x,\"1,2\"").expect("write");
        w.write_line("").expect("write");
        w.finish().expect("finish");
        let text = fs::read_to_string(dir.join("part-3.csv")).expect("read");
        assert_eq!(text, "k,v\nx,\"1,2\"\n\n");
    }

    #[test]
    fn create_truncates_an_old_file() {
        let tmp = tempfile::tempdir().expect("temp dir");
        fs::write(
            tmp.path().join("part-0.csv"),
            "old contents that are longer\n",
        )
        .expect("seed");
        let mut w = FileSinkWriter::create(tmp.path(), 0).expect("create");
        w.write_line("new").expect("write");
        w.finish().expect("finish");
        assert_eq!(
            fs::read_to_string(tmp.path().join("part-0.csv")).expect("read"),
            "new\n"
        );
    }

    #[test]
    fn buffers_until_finish_and_handles_large_output() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let mut w = FileSinkWriter::create(tmp.path(), 1).expect("create");
        w.write_line("first").expect("write");
        // Still in the buffer: the file is empty until a flush.
        assert_eq!(fs::metadata(w.path()).expect("stat").len(), 0);
        let line = "y".repeat(999);
        for _ in 0..200 {
            w.write_line(&line).expect("write");
        }
        w.finish().expect("finish");
        let text = fs::read_to_string(w.path()).expect("read");
        assert_eq!(text.len(), 6 + 200 * 1000);
        assert!(text.starts_with("first\n"));
        assert!(text.lines().skip(1).all(|l| l == line));
        // Finishing twice is harmless.
        w.finish().expect("second finish");
    }

    #[test]
    fn create_fails_with_the_path_when_the_directory_is_a_file() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let blocker = tmp.path().join("blocker");
        fs::write(&blocker, "x").expect("seed");
        let err = FileSinkWriter::create(&blocker, 0).expect_err("a file is not a directory");
        assert!(err.to_string().contains("blocker"), "{err}");
    }
}
