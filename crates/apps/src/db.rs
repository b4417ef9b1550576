//! The databases: MariaDB (InnoDB) and PostgreSQL servers started on a data directory, their
//! clients, and the load generators (sysbench with the modified schema, pgbench).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use zdisk_bench::sys::{self, progress, run, tool, Tool};

pub const LUA: &str = include_str!("zdisk_oltp.lua");

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Db {
    Mysql,
    Postgres,
}

impl Db {
    pub fn tools(self) -> Vec<Tool> {
        let mut t = vec![
            tool("sysbench", "sysbench"),
            tool("nbdkit", "nbdkit"),
            tool("nbdfuse", "libnbd-bin"),
            tool("qemu-nbd", "qemu-utils"),
            tool("fusermount3", "fuse3"),
            tool("losetup", "util-linux"),
            tool("mkfs.ext4", "e2fsprogs"),
            tool("mount", "mount"),
        ];
        match self {
            Db::Mysql => t.extend([
                tool("mariadbd", "mariadb-server"),
                tool("mariadb-install-db", "mariadb-server"),
                tool("mariadb", "mariadb-client"),
                tool("mariadb-admin", "mariadb-client"),
                tool("innochecksum", "mariadb-server"),
            ]),
            Db::Postgres => t.extend([
                tool("postgres", "postgresql"),
                tool("initdb", "postgresql"),
                tool("pg_ctl", "postgresql"),
                tool("psql", "postgresql-client"),
                tool("pgbench", "postgresql-contrib"),
                tool("pg_amcheck", "postgresql"),
                tool("pg_checksums", "postgresql"),
                tool("runuser", "util-linux"),
            ]),
        }
        t
    }

    pub fn name(self) -> &'static str {
        match self {
            Db::Mysql => "mysql",
            Db::Postgres => "postgres",
        }
    }

    /// What protects against torn pages, and its name in this database.
    pub fn torn_page_guard(self) -> &'static str {
        match self {
            Db::Mysql => "innodb_doublewrite",
            Db::Postgres => "full_page_writes",
        }
    }
}

/// Server settings scaled from the whitepaper's my.cnf (buffer pool much smaller than the data,
/// O_DIRECT, no binary log, no adaptive hash index).
#[derive(Clone, Debug, Serialize)]
pub struct ServerConfig {
    pub buffer_pool: u64,
    pub log_file_size: u64,
    /// Doublewrite (MariaDB) or full_page_writes (PostgreSQL).
    pub torn_page_guard: bool,
}

/// A running database server in its own process group. Dropping it stops it cleanly
/// (SIGKILL if it does not stop within 5 minutes).
pub struct Server {
    pub db: Db,
    child: Option<Child>,
    pub pid: u32,
    pub socket: PathBuf,
    pub log: PathBuf,
    datadir: PathBuf,
}

fn wait_ready(child: &mut Child, log: &Path, timeout: Duration, ready: &dyn Fn() -> bool) -> Result<()> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            let tail = tail_of(log, 30);
            bail!("database server exited ({status}) while starting; log {}:\n{tail}", log.display());
        }
        if ready() {
            return Ok(());
        }
        if Instant::now() > end {
            bail!("database server not ready within {} s; log {}", timeout.as_secs(), log.display());
        }
        sys::check_interrupt()?;
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn tail_of(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

// ---------------------------------------------------------------------------------------------
// MariaDB

pub fn mysql_install(datadir: &Path) -> Result<()> {
    std::fs::create_dir_all(datadir)?;
    // Its own temporary directory, as the server gets: with the default (/tmp) a bootstrap
    // running beside another test's failed in CI ("Could not remove temporary table
    // '/tmp/#sql-temptable-…'").
    let tmp = datadir.with_file_name("tmp");
    std::fs::create_dir_all(&tmp)?;
    run(sys::cmd("mariadb-install-db")?
        .arg("--no-defaults")
        .arg(format!("--datadir={}", datadir.display()))
        .args(["--user=root", "--auth-root-authentication-method=normal", "--skip-test-db", "--skip-name-resolve"])
        .arg(format!("--tmpdir={}", tmp.display())))
    .context("mariadb-install-db")?;
    Ok(())
}

pub fn mysql_start(datadir: &Path, socket: &Path, log: &Path, cfg: &ServerConfig) -> Result<Server> {
    let tmp = datadir.with_file_name("tmp");
    std::fs::create_dir_all(&tmp)?;
    let _ = std::fs::remove_file(socket);
    let mut c = sys::cmd("mariadbd")?;
    c.arg("--no-defaults")
        .arg("--user=root")
        .arg(format!("--datadir={}", datadir.display()))
        .arg(format!("--socket={}", socket.display()))
        .arg(format!("--pid-file={}", socket.with_extension("pid").display()))
        .arg(format!("--log-error={}", log.display()))
        .arg(format!("--tmpdir={}", tmp.display()))
        .arg("--skip-networking")
        .arg("--skip-log-bin")
        .arg("--sync-binlog=0")
        .arg("--slow-query-log=0")
        .arg("--max-connections=500")
        .arg("--max-prepared-stmt-count=4000000")
        .arg(format!("--innodb-buffer-pool-size={}", cfg.buffer_pool))
        .arg(format!("--innodb-log-file-size={}", cfg.log_file_size))
        .arg("--innodb-flush-method=O_DIRECT")
        .arg("--innodb-flush-log-at-trx-commit=1")
        .arg("--innodb-adaptive-hash-index=0")
        .arg("--innodb-file-per-table=1")
        .arg("--innodb-purge-threads=4")
        .arg(format!("--innodb-doublewrite={}", u8::from(cfg.torn_page_guard)))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = sys::spawn(&mut c)?;
    let pid = child.id();
    let sock = socket.to_path_buf();
    let ready = move || {
        sock.exists()
            && sys::cmd("mariadb-admin")
                .map(|mut c| run(c.arg(format!("--socket={}", sock.display())).args(["-uroot", "ping"])).is_ok())
                .unwrap_or(false)
    };
    if let Err(e) = wait_ready(&mut child, log, Duration::from_secs(600), &ready) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    Ok(Server {
        db: Db::Mysql,
        child: Some(child),
        pid,
        socket: socket.to_path_buf(),
        log: log.into(),
        datadir: datadir.into(),
    })
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL (runs as the `postgres` user: it refuses root)

fn as_postgres(program: &str) -> Result<Command> {
    let mut c = sys::cmd("runuser")?;
    c.args(["-u", "postgres", "--"]).arg(sys::path_of(program)?);
    Ok(c)
}

pub fn chown_postgres(path: &Path) -> Result<()> {
    run(sys::cmd("chown")?.args(["-R", "postgres:postgres"]).arg(path))?;
    Ok(())
}

pub fn pg_initdb(datadir: &Path) -> Result<()> {
    std::fs::create_dir_all(datadir)?;
    chown_postgres(datadir)?;
    run(as_postgres("initdb")?.arg("-D").arg(datadir).args([
        "--data-checksums",
        "-U",
        "postgres",
        "--auth=trust",
        "-E",
        "UTF8",
        "--locale=C",
    ]))
    .context("initdb")?;
    Ok(())
}

pub fn pg_start(datadir: &Path, socket_dir: &Path, log: &Path, cfg: &ServerConfig) -> Result<Server> {
    std::fs::create_dir_all(socket_dir)?;
    chown_postgres(socket_dir)?;
    let logf = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
    chown_postgres(log)?;
    let mut c = as_postgres("postgres")?;
    c.arg("-D")
        .arg(datadir)
        .arg("-c")
        .arg(format!("unix_socket_directories={}", socket_dir.display()))
        .args(["-c", "listen_addresses="])
        .arg("-c")
        .arg(format!("shared_buffers={}kB", cfg.buffer_pool / 1024))
        .arg("-c")
        .arg(format!("max_wal_size={}MB", (cfg.log_file_size >> 20).max(64)))
        .arg("-c")
        .arg(format!("full_page_writes={}", if cfg.torn_page_guard { "on" } else { "off" }))
        .args(["-c", "max_connections=300", "-c", "fsync=on", "-c", "synchronous_commit=on"])
        .args(["-c", "wal_sync_method=fdatasync", "-c", "checkpoint_timeout=60s", "-c", "autovacuum=on"])
        .stdout(logf.try_clone()?)
        .stderr(logf);
    let mut child = sys::spawn(&mut c)?;
    let pid = child.id();
    let sd = socket_dir.to_path_buf();
    let ready = move || {
        sys::cmd("pg_isready")
            .map(|mut c| run(c.arg("-h").arg(&sd).args(["-U", "postgres", "-q"])).is_ok())
            .unwrap_or(false)
    };
    if let Err(e) = wait_ready(&mut child, log, Duration::from_secs(600), &ready) {
        if let Err(k) = kill_server(Db::Postgres, &mut child, datadir) {
            progress(&format!("teardown: {k:#}"));
        }
        return Err(e);
    }
    Ok(Server {
        db: Db::Postgres,
        child: Some(child),
        pid,
        socket: socket_dir.into(),
        log: log.into(),
        datadir: datadir.into(),
    })
}

/// How long the processes of a killed server may take to go away (a process in the middle of
/// I/O on a device whose server died dies when that I/O fails).
const KILL_TIMEOUT: Duration = Duration::from_secs(60);

/// SIGKILL of a database server and every process of it, then waits until all are gone, so
/// that none can touch the data directory again (and the filesystem can be unmounted):
///
/// - MariaDB: `mariadbd` itself (our child).
/// - PostgreSQL: our child is `runuser`, the postmaster is its child, and every backend and
///   auxiliary process calls setsid(): a signal to our child's process group reaches runuser
///   and the postmaster only. The backends lived on, on the dead device, and kept the
///   filesystem busy; the postmaster, orphaned by runuser's death, stayed a zombie until init
///   reaped it (1–2 s later, measured here), and while its pid — also in postmaster.pid on
///   the recovered disk — answered kill(pid, 0), the recovery start refused ("Is another
///   postmaster running?"). So the postmaster and all its children are killed by pid, runuser
///   (still alive) reaps the postmaster and exits (it is killed if it does not), and the
///   postmaster's pid is waited for until it has left the process table.
///
/// Any process left with something open under the data directory is killed too. Fails, naming
/// the survivors, if they are not all gone within a minute.
pub fn kill_server(db: Db, child: &mut Child, datadir: &Path) -> Result<()> {
    let pid = child.id();
    let roots = match db {
        Db::Mysql => vec![pid],
        Db::Postgres => match sys::children_of(pid) {
            postmaster if !postmaster.is_empty() => postmaster,
            _ => vec![pid],
        },
    };
    let killed = sys::kill_all(&roots, &[datadir], KILL_TIMEOUT)
        .with_context(|| format!("killing the {} server (pid {pid})", db.name()));
    // Our child: runuser exits once the postmaster has; mariadbd was killed above.
    let end = Instant::now() + Duration::from_secs(10);
    while child.try_wait()?.is_none() {
        if Instant::now() > end {
            sys::signal(pid, libc::SIGKILL);
            child.wait()?;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let killed = killed?;
    let outside = killed.iter().filter(|p| p.pgid != pid).count();
    progress(&format!(
        "{} server killed: {} process{}{}",
        db.name(),
        killed.len(),
        if killed.len() == 1 { "" } else { "es" },
        if outside > 0 { format!(", {outside} of them outside its process group") } else { String::new() }
    ));
    for r in roots {
        if !sys::wait_reaped(r, Duration::from_secs(30)) {
            bail!("the {} server's pid {r} is still in the process table 30 s after SIGKILL", db.name());
        }
    }
    Ok(())
}

impl Server {
    /// One SQL statement (or several); tab-separated rows without headers.
    pub fn sql(&self, db: &str, query: &str) -> Result<String> {
        match self.db {
            Db::Mysql => {
                let mut c = sys::cmd("mariadb")?;
                c.arg(format!("--socket={}", self.socket.display())).args(["-uroot", "-N", "-B"]);
                if !db.is_empty() {
                    c.arg(format!("--database={db}"));
                }
                run(c.arg("-e").arg(query))
            }
            Db::Postgres => run(sys::cmd("psql")?
                .arg("-h")
                .arg(&self.socket)
                .args(["-U", "postgres", "-X", "-A", "-t", "-F", "\t", "-v", "ON_ERROR_STOP=1"])
                .arg("-d")
                .arg(if db.is_empty() { "postgres" } else { db })
                .arg("-c")
                .arg(query)),
        }
    }

    /// SIGKILL of the server and every process of it, and waits until they are gone: see
    /// [`kill_server`].
    pub fn kill(&mut self) -> Result<()> {
        match self.child.take() {
            Some(mut child) => kill_server(self.db, &mut child, &self.datadir),
            None => Ok(()),
        }
    }

    pub fn stop(mut self) -> Result<()> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else { return Ok(()) };
        match self.db {
            Db::Mysql => {
                let _ = run(sys::cmd("mariadb-admin")?
                    .arg(format!("--socket={}", self.socket.display()))
                    .args(["-uroot", "shutdown"]));
            }
            Db::Postgres => {
                // SIGINT to the postmaster (not to runuser, which does not pass it on): "fast"
                // shutdown, clean, with a shutdown checkpoint.
                let pm = std::fs::read_to_string(self.datadir.join("postmaster.pid"))
                    .ok()
                    .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<u32>().ok()));
                sys::signal(pm.unwrap_or(self.pid), libc::SIGINT);
            }
        }
        let end = Instant::now() + Duration::from_secs(300);
        loop {
            if let Some(status) = child.try_wait()? {
                if !status.success() {
                    bail!("database server exited with {status} at shutdown; log {}", self.log.display());
                }
                return Ok(());
            }
            if Instant::now() > end {
                kill_server(self.db, &mut child, &self.datadir)?;
                bail!("database server did not stop within 5 minutes; killed");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Sysbench's connection options for this server.
    pub fn sysbench_args(&self) -> Vec<String> {
        match self.db {
            Db::Mysql => vec![
                "--db-driver=mysql".into(),
                format!("--mysql-socket={}", self.socket.display()),
                "--mysql-user=root".into(),
                "--mysql-db=sbtest".into(),
                "--mysql-ignore-errors=1213,1205,1020".into(),
            ],
            Db::Postgres => vec![
                "--db-driver=pgsql".into(),
                format!("--pgsql-host={}", self.socket.display()),
                "--pgsql-user=postgres".into(),
                "--pgsql-db=sbtest".into(),
                // sysbench 1.0.20's pgsql driver corrupts its prepared statements with the
                // modified schema's long text parameters at the quick preset's sizes ("prepared
                // statement \"<text>\" does not exist", then SIGSEGV or a double free, on raw
                // and zdisk alike); plain queries work.
                "--db-ps-mode=disable".into(),
            ],
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.is_some() {
            if let Err(e) = self.stop_inner() {
                progress(&format!("teardown: {e:#}"));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Load generators

#[derive(Clone, Debug, Default, Serialize)]
pub struct LoadResult {
    pub tps: f64,
    pub qps: f64,
    pub transactions: u64,
    pub p95_ms: f64,
    pub avg_ms: f64,
    pub errors: u64,
    pub seconds: f64,
    /// Transactions per second in each reported interval (warm-up excluded where the tool can).
    pub per_second: Vec<f64>,
}

/// A load generator running in its own process group.
pub struct Load {
    child: Child,
    out: PathBuf,
    kind: &'static str,
}

impl Load {
    pub fn spawn(mut command: Command, out: &Path, kind: &'static str) -> Result<Load> {
        let f = std::fs::File::create(out)?;
        command.stdout(f.try_clone()?).stderr(f);
        Ok(Load { child: sys::spawn(&mut command)?, out: out.into(), kind })
    }

    pub fn kill(&mut self) {
        sys::signal_group(self.child.id(), libc::SIGKILL);
        let _ = self.child.wait();
    }

    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The intervals the tool has reported so far (sysbench's and pgbench's per-second
    /// progress lines, each naming its tps).
    pub fn intervals_reported(&self) -> usize {
        std::fs::read_to_string(&self.out).unwrap_or_default().lines().filter(|l| l.contains("tps")).count()
    }

    /// Waits until the tool reports its first interval: its clients are connected and
    /// transactions run. Fails if it ends first or reports nothing within `timeout`.
    pub fn wait_for_first_report(&mut self, timeout: Duration) -> Result<()> {
        let end = Instant::now() + timeout;
        while self.intervals_reported() == 0 {
            if !self.running() {
                bail!("{} ended before its first report:\n{}", self.kind, tail_of(&self.out, 20));
            }
            if Instant::now() > end {
                bail!("{} reported nothing within {} s:\n{}", self.kind, timeout.as_secs(), tail_of(&self.out, 20));
            }
            sys::check_interrupt()?;
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Waits for the end (checking Ctrl-C) and parses the tool's summary.
    pub fn finish(mut self, timeout: Duration) -> Result<LoadResult> {
        let end = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait()? {
                break s;
            }
            if sys::interrupted() || Instant::now() > end {
                self.kill();
                sys::check_interrupt()?;
                bail!("{} did not finish within {} s", self.kind, timeout.as_secs());
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        if !status.success() {
            bail!("{} failed ({status}); output {}:\n{}", self.kind, self.out.display(), tail_of(&self.out, 20));
        }
        match self.kind {
            "pgbench" => parse_pgbench(&text),
            _ => parse_sysbench(&text),
        }
        .with_context(|| format!("parsing {}", self.out.display()))
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.kill();
        }
    }
}

fn number_after(line: &str, key: &str) -> Option<f64> {
    let rest = line.split_once(key)?.1;
    rest.split_whitespace().next()?.trim_end_matches(',').parse().ok()
}

fn in_parens(line: &str) -> Option<f64> {
    line.split_once('(')?.1.split_whitespace().next()?.parse().ok()
}

pub fn parse_sysbench(text: &str) -> Result<LoadResult> {
    let mut r = LoadResult::default();
    let mut have_tps = false;
    for line in text.lines() {
        let l = line.trim();
        if l.starts_with('[') && l.contains(" tps: ") {
            if let Some(t) = number_after(l, "tps:") {
                r.per_second.push(t);
            }
        } else if let Some(rest) = l.strip_prefix("transactions:") {
            r.transactions = rest.split_whitespace().next().and_then(|x| x.parse().ok()).unwrap_or(0);
            r.tps = in_parens(rest).unwrap_or(0.0);
            have_tps = true;
        } else if let Some(rest) = l.strip_prefix("queries:") {
            r.qps = in_parens(rest).unwrap_or(0.0);
        } else if let Some(rest) = l.strip_prefix("ignored errors:") {
            r.errors = rest.split_whitespace().next().and_then(|x| x.parse().ok()).unwrap_or(0);
        } else if let Some(rest) = l.strip_prefix("95th percentile:") {
            r.p95_ms = rest.trim().parse().unwrap_or(0.0);
        } else if let Some(rest) = l.strip_prefix("avg:") {
            r.avg_ms = rest.trim().parse().unwrap_or(0.0);
        } else if let Some(rest) = l.strip_prefix("total time:") {
            r.seconds = rest.trim().trim_end_matches('s').parse().unwrap_or(0.0);
        }
    }
    if !have_tps {
        bail!("no 'transactions:' line in sysbench's output");
    }
    Ok(r)
}

pub fn parse_pgbench(text: &str) -> Result<LoadResult> {
    let mut r = LoadResult::default();
    let mut have_tps = false;
    for line in text.lines() {
        let l = line.trim();
        if l.starts_with("progress:") {
            if let Some(t) = number_after(l, " s, ") {
                r.per_second.push(t);
            }
        } else if l.starts_with("tps = ") {
            r.tps = number_after(l, "tps =").unwrap_or(0.0);
            r.qps = r.tps * 7.0;
            have_tps = true;
        } else if let Some(rest) = l.strip_prefix("number of transactions actually processed:") {
            r.transactions = rest.split_whitespace().next().and_then(|x| x.parse().ok()).unwrap_or(0);
        } else if let Some(rest) = l.strip_prefix("number of failed transactions:") {
            r.errors = rest.split_whitespace().next().and_then(|x| x.parse().ok()).unwrap_or(0);
        } else if l.starts_with("latency average") {
            r.avg_ms = number_after(l, "=").unwrap_or(0.0);
        } else if let Some(rest) = l.strip_prefix("duration:") {
            r.seconds = rest.split_whitespace().next().and_then(|x| x.parse().ok()).unwrap_or(0.0);
        }
    }
    if !have_tps {
        bail!("no 'tps =' line in pgbench's output");
    }
    Ok(r)
}

/// p95 of pgbench's per-transaction log (`--log`), in ms: pgbench prints no percentile itself.
pub fn pgbench_p95_ms(log_prefix: &Path) -> Option<f64> {
    let dir = log_prefix.parent()?;
    let stem = log_prefix.file_name()?.to_string_lossy().into_owned();
    let mut lat: Vec<f64> = Vec::new();
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        if e.file_name().to_string_lossy().starts_with(&stem) {
            for line in std::fs::read_to_string(e.path()).ok()?.lines() {
                // client_id transaction_no time script_no time_epoch time_us
                if let Some(us) = line.split_whitespace().nth(2).and_then(|x| x.parse::<f64>().ok()) {
                    lat.push(us / 1000.0);
                }
            }
            let _ = std::fs::remove_file(e.path());
        }
    }
    if lat.is_empty() {
        return None;
    }
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Some(lat[((lat.len() as f64 * 0.95) as usize).min(lat.len() - 1)])
}

pub fn sysbench_command(server: &Server, lua: &Path, text: &Path, tables: u32, table_size: u64) -> Result<Command> {
    let mut c = sys::cmd("sysbench")?;
    // Run from the script's directory so `require("oltp_common")` finds sysbench's own.
    c.current_dir("/usr/share/sysbench")
        .arg(lua)
        .args(server.sysbench_args())
        .arg(format!("--tables={tables}"))
        .arg(format!("--table-size={table_size}"))
        .arg(format!("--text_file={}", text.display()));
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sysbench_summary() {
        let text = "[ 1s ] thds: 4 tps: 101.50 qps: 2000.10 (r/w/o: 1/1/1) lat (ms,95%): 50.11 err/s: 0.00 reconn/s: 0.00\n\
SQL statistics:\n    transactions:                        1234   (123.40 per sec.)\n    queries:                             24680  (2468.00 per sec.)\n    ignored errors:                      3      (0.30 per sec.)\nGeneral statistics:\n    total time:                          10.0012s\nLatency (ms):\n         avg:                                   32.40\n         95th percentile:                       57.87\n";
        let r = parse_sysbench(text).unwrap();
        assert_eq!(r.transactions, 1234);
        assert!((r.tps - 123.4).abs() < 1e-9);
        assert!((r.qps - 2468.0).abs() < 1e-9);
        assert!((r.p95_ms - 57.87).abs() < 1e-9);
        assert!((r.avg_ms - 32.4).abs() < 1e-9);
        assert_eq!(r.errors, 3);
        assert_eq!(r.per_second, vec![101.5]);
        assert!(parse_sysbench("FATAL: nothing").is_err());
    }

    #[test]
    fn parses_pgbench_summary() {
        let text = "progress: 1.0 s, 311.9 tps, lat 12.776 ms stddev 9.1, 0 failed\n\
number of transactions actually processed: 3120\nnumber of failed transactions: 0 (0.000%)\nlatency average = 12.812 ms\ntps = 311.52 (without initial connection time)\n";
        let r = parse_pgbench(text).unwrap();
        assert_eq!(r.transactions, 3120);
        assert!((r.tps - 311.52).abs() < 1e-9);
        assert!((r.avg_ms - 12.812).abs() < 1e-9);
        assert_eq!(r.per_second, vec![311.9]);
    }
}
