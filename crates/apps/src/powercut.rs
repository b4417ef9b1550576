//! `zdisk db powercut`: the proof behind doublewrite-off. A write-heavy load runs on a database
//! (MariaDB with innodb_doublewrite=OFF; PostgreSQL with data checksums, and full_page_writes
//! on unless asked otherwise — PostgreSQL writes pages through the page cache, whose writeback
//! may split them, so off is not advised and not what CI asserts; docs/guarantees.md) on zdisk
//! attached as a block device; at a seeded random moment zdisk's server (nbdkit) and the
//! database are SIGKILLed together. Then the store is checked, re-attached, every page is
//! verified before and after the database's own recovery, and the data's invariants are
//! checked.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::corpus;
use crate::db::{self, Db, Load, Server, ServerConfig};
use crate::stack::{self, Ctx, Device, Mount};
use crate::PowercutArgs;
use zdisk_bench::sys::{self, progress};

/// How long a cycle's load may take to connect and report its first interval (the database
/// has just finished its crash recovery).
const LOAD_START_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Debug, Default, Serialize)]
pub struct Cycle {
    pub cycle: u32,
    pub cut_after_s: f64,
    /// Transactions the load reported before the cut (from its per-second lines).
    pub load_seconds_reported: usize,
    pub zdisk_check_clean: bool,
    /// Pages that failed their checksum before the database's recovery (torn or corrupt).
    pub bad_pages_before_recovery: u64,
    /// ... and after recovery and a clean shutdown.
    pub bad_pages_after_recovery: u64,
    pub recovered: bool,
    pub recovery_errors: Vec<String>,
    /// CHECK TABLE (MySQL) or pg_amcheck (PostgreSQL) clean.
    pub tables_ok: bool,
    /// The load's invariant: row counts (sysbench delete+insert) or pgbench's balance sums.
    pub invariant_ok: bool,
    pub details: Vec<String>,
    pub passed: bool,
}

#[derive(Debug, Serialize)]
pub struct Result_ {
    pub schema: &'static str,
    pub db: Db,
    pub seed: u64,
    pub command: String,
    pub replay: String,
    pub checker_self_test: Option<String>,
    /// The database's own torn-page protection (doublewrite, full_page_writes) was on.
    pub torn_page_guard: bool,
    pub cycles: Vec<Cycle>,
    pub bad_pages_total: u64,
    pub failed_cycles: u32,
    pub loadavg: String,
}

struct Setup {
    tables: u32,
    table_size: u64,
    scale: u32,
    cycles: u32,
    cut: (f64, f64),
    torn_page_guard: bool,
}

pub fn run(a: &PowercutArgs) -> Result<()> {
    sys::require_tools(&format!("zdisk db powercut {}", a.db.name()), &a.db.tools())?;
    if unsafe { libc::geteuid() } != 0 {
        bail!("zdisk db powercut needs root (mkfs, mount, losetup)");
    }
    let setup = Setup {
        tables: if a.smoke { 2 } else { 4 },
        table_size: if a.smoke { 2000 } else { 20000 },
        scale: if a.smoke { 2 } else { 10 },
        cycles: a.cycles.unwrap_or(if a.smoke { 2 } else { 20 }),
        cut: match &a.cut_after {
            Some(v) if v.len() == 2 && v[0] > 0.0 && v[1] >= v[0] => (v[0], v[1]),
            Some(_) => bail!("--cut-after takes MIN,MAX seconds with 0 < MIN <= MAX"),
            None if a.smoke => (1.0, 3.0),
            None => (3.0, 20.0),
        },
        torn_page_guard: a.torn_page_guard.unwrap_or(a.db == Db::Postgres),
    };
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    let replay = replay_command(a, &setup, seed);
    println!("powercut seed {seed} (replay: {replay})");
    progress(&format!("powercut {}: {} cycles, seed {seed}", a.db.name(), setup.cycles));
    let base = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    let work = base.join(format!("zdisk-powercut-{}-{}", a.db.name(), sys::unix_time()));
    for dir in [work.join("run"), work.join("out")] {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let zdisk_bin = zdisk_bench::zdisk_bin(&a.zdisk_bin)?;
    let ctx = Ctx {
        work: work.clone(),
        zdisk_bin,
        run_dir: sys::short_run_dir()?,
        serve_options: crate::serve_options(&a.serve_options),
    };
    let mut result = Result_ {
        schema: "zdisk-db-powercut/1",
        db: a.db,
        seed,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        replay: replay.clone(),
        checker_self_test: None,
        torn_page_guard: setup.torn_page_guard,
        cycles: Vec::new(),
        bad_pages_total: 0,
        failed_cycles: 0,
        loadavg: sys::loadavg(),
    };
    let outcome = cycles(&ctx, a, &setup, seed, &mut result);
    result.bad_pages_total =
        result.cycles.iter().map(|c| c.bad_pages_before_recovery + c.bad_pages_after_recovery).sum();
    result.failed_cycles = result.cycles.iter().filter(|c| !c.passed).count() as u32;
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("zdisk-powercut-{}-{}.json", a.db.name(), sys::unix_time())));
    std::fs::write(&out, serde_json::to_string_pretty(&result)?)?;
    let failed = result.failed_cycles;
    if failed == 0 && outcome.is_ok() {
        if !a.keep {
            let _ = std::fs::remove_dir_all(&work);
        }
    } else {
        progress(&format!("work directory kept for inspection: {}", work.display()));
    }
    let _ = std::fs::remove_dir_all(&ctx.run_dir);
    outcome?;
    println!(
        "powercut {}: {} cycles, {} failed, {} bad pages; result {} (seed {seed})",
        a.db.name(),
        result.cycles.len(),
        failed,
        result.bad_pages_total,
        out.display()
    );
    if failed > 0 {
        bail!("{failed} of {} power-cut cycles failed; replay: {replay}", result.cycles.len());
    }
    Ok(())
}

/// The command that reruns this run's cuts (the cut moments come from the seed).
fn replay_command(a: &PowercutArgs, setup: &Setup, seed: u64) -> String {
    format!(
        "zdisk db powercut {} --seed {seed} --cycles {} --cut-after {},{} --threads {} --torn-page-guard {}{}",
        a.db.name(),
        setup.cycles,
        setup.cut.0,
        setup.cut.1,
        a.threads,
        if setup.torn_page_guard { "on" } else { "off" },
        if a.smoke { " --smoke" } else { "" }
    )
}

fn server_config(torn_page_guard: bool) -> ServerConfig {
    ServerConfig { buffer_pool: 32 << 20, log_file_size: 96 << 20, torn_page_guard }
}

fn attach_and_mount(ctx: &Ctx, store: &Path, mnt: &Path) -> Result<(Mount, Device)> {
    let dev = Device::zdisk_attach(ctx, store)?;
    if !dev.dio {
        bail!("{} does not do direct I/O on the nbdfuse file: pages may be split; refusing", dev.path.display());
    }
    let m = Mount::new(&dev.path, mnt, "noatime")?;
    Ok((m, dev))
}

fn start(ctx: &Ctx, db: Db, setup: &Setup, datadir: &Path) -> Result<Server> {
    let config = server_config(setup.torn_page_guard);
    let log = ctx.work.join(format!("{}.log", db.name()));
    match db {
        Db::Mysql => db::mysql_start(datadir, &ctx.run_dir.join("mysql.sock"), &log, &config),
        Db::Postgres => db::pg_start(datadir, &ctx.run_dir.join("pg"), &log, &config),
    }
}

/// The store's physical and logical size.
const STORE_BYTES: u64 = 2 << 30;

fn cycles(ctx: &Ctx, a: &PowercutArgs, setup: &Setup, seed: u64, result: &mut Result_) -> Result<()> {
    let db = a.db;
    let text = ctx.work.join("text.txt");
    corpus::write_text_lines(&text)?;
    let lua = ctx.work.join("zdisk_oltp.lua");
    std::fs::write(&lua, db::LUA)?;
    let store = ctx.work.join("db.zdisk");
    let format_args: Vec<String> = a.zdisk_codec.iter().flat_map(|c| ["--codec".to_string(), c.clone()]).collect();
    let mnt = ctx.work.join("mnt");
    let datadir = mnt.join(if db == Db::Mysql { "mysql" } else { "pgdata" });

    // Load once, with the run's torn-page guard from the start.
    load_data_set(ctx, db, setup, (&store, &mnt, &datadir), (&lua, &text), &format_args, result)?;

    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for n in 1..=setup.cycles {
        sys::check_interrupt()?;
        let cut_after = rng.gen_range(setup.cut.0..=setup.cut.1);
        let mut cy = Cycle { cycle: n, cut_after_s: cut_after, ..Default::default() };
        progress(&format!("cycle {n}/{}: load, cut after {cut_after:.2} s", setup.cycles));
        let (m, dev) = attach_and_mount(ctx, &store, &mnt)?;
        let mut server = start(ctx, db, setup, &datadir)?;
        let out = ctx.work.join("out").join(format!("cycle{n}.out"));
        let mut load = match db {
            Db::Mysql => {
                let mut c = db::sysbench_command(&server, &lua, &text, setup.tables, setup.table_size)?;
                c.args(["--workload=write_only", "--time=3600", "--report-interval=1", "--rand-type=uniform"])
                    .arg(format!("--threads={}", a.threads))
                    .arg("run");
                Load::spawn(c, &out, "sysbench")?
            }
            Db::Postgres => {
                let mut c = sys::cmd("pgbench")?;
                c.arg("-h")
                    .arg(&server.socket)
                    .args(["-U", "postgres", "-n", "-P", "1", "-T", "3600", "-j", "2"])
                    .arg(format!("-c{}", a.threads))
                    .arg("sbtest");
                Load::spawn(c, &out, "pgbench")?
            }
        };
        // The cut falls `cut_after` seconds into the load itself: timed from the spawn, a
        // cut at 1 s could come before the tool had connected (CI saw a cycle cut at 1.05 s
        // with no interval reported).
        load.wait_for_first_report(LOAD_START_TIMEOUT)?;
        sys::sleep(Duration::from_secs_f64(cut_after))?;
        if !load.running() {
            bail!("the load ended before the cut: {}", db::tail_of(&out, 20));
        }
        // The power cut: the storage server first, the database in the same instant.
        dev.kill_server()?;
        let db_killed = server.kill();
        load.kill();
        cy.load_seconds_reported = load.intervals_reported();
        // Nothing of the cut-off server may live on: a process left running on the dead
        // device keeps the filesystem busy (and so the loop device and the FUSE mount), and a
        // postmaster pid that still answers kill(pid, 0) makes the recovery start refuse its
        // postmaster.pid. Every process is dead and reaped, and no process has anything open
        // under the mount, before it is unmounted and the store recovered.
        db_killed.context("after the power cut")?;
        sys::kill_all(&[], &[&m.dir], Duration::from_secs(60))
            .context("after the power cut: processes using the database's filesystem")?;
        drop(server);
        m.unmount_after_cut()?;
        dev.detach_after_cut()?;

        let check = ctx.zdisk().arg("check").arg(&store).output()?;
        cy.zdisk_check_clean = check.status.success();
        if !cy.zdisk_check_clean {
            cy.details.push(format!("zdisk check: {}", String::from_utf8_lossy(&check.stdout).trim()));
        }

        recover_and_verify(ctx, db, setup, (&store, &mnt, &datadir), &mut cy)?;
        cy.passed = cy.zdisk_check_clean
            && cy.recovered
            && cy.recovery_errors.is_empty()
            && cy.tables_ok
            && cy.invariant_ok
            // With the guard on, a page torn by the cut is the guard's to repair in recovery.
            && (setup.torn_page_guard || cy.bad_pages_before_recovery == 0)
            && cy.bad_pages_after_recovery == 0;
        report_cycle(n, &cy);
        result.cycles.push(cy);
    }
    Ok(())
}

/// Recovery messages that mean damage (the log from `from` on).
fn recovery_errors(log: &Path, from: u64, db: Db) -> Vec<String> {
    let text = std::fs::read(log).unwrap_or_default();
    let text = String::from_utf8_lossy(&text[(from as usize).min(text.len())..]).into_owned();
    let bad: &[&str] = match db {
        Db::Mysql => &["corrupt", "Database page", "checksum mismatch", "torn", "[ERROR]"],
        Db::Postgres => &["invalid page", "checksum", "PANIC", "could not read block", "invalid record"],
    };
    text.lines()
        .filter(|l| bad.iter().any(|b| l.contains(b)))
        // PostgreSQL prints "invalid record length ... : expected at least" at the end of WAL on
        // every crash recovery: that is where the log ends, not damage.
        .filter(|l| !(db == Db::Postgres && l.contains("invalid record length") && l.contains("LOG:")))
        .map(String::from)
        .collect()
}

fn verify_online(server: &Server, db: Db, setup: &Setup) -> Result<(bool, bool, Vec<String>)> {
    let mut msgs = Vec::new();
    match db {
        Db::Mysql => {
            let mut tables_ok = true;
            let mut invariant_ok = true;
            for t in 1..=setup.tables {
                let out = server.sql("sbtest", &format!("CHECK TABLE sbtest{t} EXTENDED"))?;
                let status_ok = out.lines().any(|l| l.contains("status\tOK"));
                if !status_ok {
                    tables_ok = false;
                    msgs.push(format!("CHECK TABLE sbtest{t}: {}", out.trim()));
                }
                let count: u64 =
                    server.sql("sbtest", &format!("SELECT COUNT(*) FROM sbtest{t}"))?.trim().parse().unwrap_or(0);
                if count != setup.table_size {
                    invariant_ok = false;
                    msgs.push(format!("sbtest{t} holds {count} rows, not {}", setup.table_size));
                }
            }
            Ok((tables_ok, invariant_ok, msgs))
        }
        Db::Postgres => {
            let out = sys::cmd("pg_amcheck")?
                .arg("-h")
                .arg(&server.socket)
                .args(["-U", "postgres", "--install-missing", "--heapallindexed", "--parent-check", "-d", "sbtest"])
                .output()?;
            let tables_ok = out.status.success();
            if !tables_ok {
                msgs.push(format!(
                    "pg_amcheck: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            let sums = server.sql(
                "sbtest",
                "SELECT (SELECT sum(abalance) FROM pgbench_accounts), (SELECT sum(bbalance) FROM pgbench_branches), \
                 (SELECT sum(tbalance) FROM pgbench_tellers), (SELECT coalesce(sum(delta),0) FROM pgbench_history)",
            )?;
            let v: Vec<&str> = sums.trim().split('\t').collect();
            let invariant_ok = v.len() == 4 && v.iter().all(|x| *x == v[0]);
            if !invariant_ok {
                msgs.push(format!("pgbench balances disagree (accounts, branches, tellers, history): {}", sums.trim()));
            }
            Ok((tables_ok, invariant_ok, msgs))
        }
    }
}

/// innochecksum on every tablespace; returns the number of bad pages and their messages.
fn innochecksum_all(datadir: &Path) -> Result<(u64, Vec<String>)> {
    let files = sys::files_with_suffix(datadir, &[".ibd", "ibdata1", "undo001", "undo002", "undo003"]);
    if files.is_empty() {
        bail!("no tablespaces under {}", datadir.display());
    }
    let mut bad = 0;
    let mut msgs = Vec::new();
    for f in files {
        let out = sys::cmd("innochecksum")?.arg(&f).output()?;
        if !out.status.success() {
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            let n = text.lines().filter(|l| l.contains("invalid") || l.contains("Fail")).count().max(1) as u64;
            bad += n;
            msgs.push(format!(
                "innochecksum {}: {}",
                f.display(),
                text.lines().take(5).collect::<Vec<_>>().join(" | ")
            ));
        }
    }
    Ok((bad, msgs))
}

fn pg_checksums(datadir: &Path) -> Result<(u64, Vec<String>)> {
    let out = sys::cmd("runuser")?
        .args(["-u", "postgres", "--"])
        .arg(sys::path_of("pg_checksums")?)
        .arg("--check")
        .arg("-D")
        .arg(datadir)
        .output()?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() {
        return Ok((0, Vec::new()));
    }
    let bad =
        text.lines().find_map(|l| l.strip_prefix("Bad checksums:").and_then(|x| x.trim().parse().ok())).unwrap_or(1);
    Ok((bad, vec![format!("pg_checksums: {}", text.trim())]))
}

/// Proves the page checker can fail: a copy of a tablespace with one page torn (its second
/// half replaced by the next page's) must be reported by innochecksum.
fn innochecksum_self_test(ctx: &Ctx, datadir: &Path) -> Result<String> {
    let src = sys::files_with_suffix(datadir, &["sbtest1.ibd"]).into_iter().next().context("sbtest1.ibd")?;
    let copy = ctx.work.join("torn-copy.ibd");
    std::fs::copy(&src, &copy)?;
    let mut bytes = std::fs::read(&copy)?;
    let page = 16384;
    if bytes.len() < 6 * page {
        bail!("sbtest1.ibd is too small for the checker self-test");
    }
    let (a, b) = bytes.split_at_mut(5 * page);
    a[4 * page + page / 2..5 * page].copy_from_slice(&b[page / 2..page]);
    std::fs::write(&copy, &bytes)?;
    let out = sys::cmd("innochecksum")?.arg(&copy).output()?;
    let _ = std::fs::remove_file(&copy);
    if out.status.success() {
        bail!("innochecksum did not detect a deliberately torn page: the page check cannot be trusted");
    }
    Ok("innochecksum reports a deliberately torn page (page 4, second half from page 5)".into())
}

/// Formats and attaches the store, makes the filesystem and the database, and loads the data
/// set (MySQL: and self-tests the page checker); leaves the store detached.
fn load_data_set(
    ctx: &Ctx,
    db: Db,
    setup: &Setup,
    (store, mnt, datadir): (&Path, &Path, &Path),
    (lua, text): (&Path, &Path),
    format_args: &[String],
    result: &mut Result_,
) -> Result<()> {
    let dev = Device::zdisk_new(ctx, store, STORE_BYTES, STORE_BYTES, format_args)?;
    stack::mkfs_ext4(&dev.path)?;
    let m = Mount::new(&dev.path, mnt, "noatime")?;
    match db {
        Db::Mysql => db::mysql_install(datadir)?,
        Db::Postgres => {
            db::chown_postgres(&m.dir)?;
            db::pg_initdb(datadir)?
        }
    }
    let server = start(ctx, db, setup, datadir)?;
    server.sql("", "CREATE DATABASE sbtest")?;
    progress("loading the data set");
    match db {
        Db::Mysql => {
            let mut c = db::sysbench_command(&server, lua, text, setup.tables, setup.table_size)?;
            c.args(["--threads=2", "prepare"]);
            sys::run(&mut c).context("sysbench prepare")?;
        }
        Db::Postgres => {
            sys::run(
                sys::cmd("pgbench")?
                    .arg("-h")
                    .arg(&server.socket)
                    .args(["-U", "postgres", "-i", "-q", "-s"])
                    .arg(setup.scale.to_string())
                    .arg("sbtest"),
            )
            .context("pgbench -i")?;
        }
    }
    server.stop()?;
    if db == Db::Mysql {
        result.checker_self_test = Some(innochecksum_self_test(ctx, datadir)?);
    }
    m.unmount()?;
    dev.detach()?;
    Ok(())
}

/// After a cut: attach the store again, check every page before the database recovers,
/// start it (recovery), verify tables and the invariant online, check every page again.
fn recover_and_verify(ctx: &Ctx, db: Db, setup: &Setup, paths: (&Path, &Path, &Path), cy: &mut Cycle) -> Result<()> {
    let (store, mnt, datadir) = paths;
    let (m, dev) = attach_and_mount(ctx, store, mnt)?;
    if db == Db::Mysql {
        let (bad, msgs) = innochecksum_all(datadir)?;
        cy.bad_pages_before_recovery = bad;
        cy.details.extend(msgs);
    }
    let log = ctx.work.join(format!("{}.log", db.name()));
    let log_len = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
    match start(ctx, db, setup, datadir) {
        Ok(server) => {
            cy.recovered = true;
            cy.recovery_errors = recovery_errors(&log, log_len, db);
            match verify_online(&server, db, setup) {
                Ok((tables_ok, invariant_ok, msgs)) => {
                    cy.tables_ok = tables_ok;
                    cy.invariant_ok = invariant_ok;
                    cy.details.extend(msgs);
                }
                Err(e) => cy.details.push(format!("verification failed: {e:#}")),
            }
            server.stop()?;
        }
        Err(e) => cy.details.push(format!("recovery failed: {e:#}")),
    }
    let (bad, msgs) = match db {
        Db::Mysql => innochecksum_all(datadir)?,
        Db::Postgres => pg_checksums(datadir)?,
    };
    cy.bad_pages_after_recovery = bad;
    cy.details.extend(msgs);
    m.unmount()?;
    dev.detach()?;
    Ok(())
}

/// One line per cycle, and its details when it failed.
fn report_cycle(n: u32, cy: &Cycle) {
    progress(&format!(
        "cycle {n}: {} (zdisk check {}, bad pages {}+{}, tables {}, invariant {}{})",
        if cy.passed { "ok" } else { "FAILED" },
        if cy.zdisk_check_clean { "clean" } else { "DAMAGED" },
        cy.bad_pages_before_recovery,
        cy.bad_pages_after_recovery,
        if cy.tables_ok { "ok" } else { "BAD" },
        if cy.invariant_ok { "ok" } else { "BROKEN" },
        if cy.recovery_errors.is_empty() {
            String::new()
        } else {
            format!(", recovery errors: {:?}", cy.recovery_errors)
        }
    ));
    if !cy.passed {
        for d in &cy.details {
            progress(&format!("  cycle {n}: {d}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: PowercutArgs,
    }

    fn parse(line: &str) -> PowercutArgs {
        let words = line.strip_prefix("zdisk db powercut ").unwrap().split_whitespace();
        Cli::try_parse_from(std::iter::once("powercut").chain(words)).unwrap_or_else(|e| panic!("{line}: {e}")).args
    }

    /// The printed replay command must parse and mean the same run.
    #[test]
    fn replay_command_parses_back() {
        let a = parse("zdisk db powercut postgres --smoke");
        let setup = Setup { tables: 2, table_size: 2000, scale: 2, cycles: 2, cut: (1.0, 3.0), torn_page_guard: true };
        let line = replay_command(&a, &setup, 1795444955635016032);
        let b = parse(&line);
        assert_eq!(b.db, Db::Postgres);
        assert_eq!(b.seed, Some(1795444955635016032));
        assert_eq!(b.cycles, Some(2));
        assert_eq!(b.cut_after, Some(vec![1.0, 3.0]));
        assert_eq!(b.threads, 16);
        assert!(b.smoke);
        assert_eq!(b.torn_page_guard, Some(true));
        let c = parse("zdisk db powercut mysql --cut-after 2.5,7 --threads 4");
        let d = parse(&replay_command(&c, &Setup { cycles: 20, cut: (2.5, 7.0), torn_page_guard: false, ..setup }, 7));
        assert_eq!((d.db, d.seed, d.cycles, d.threads, d.smoke), (Db::Mysql, Some(7), Some(20), 4, false));
        assert_eq!(d.cut_after, Some(vec![2.5, 7.0]));
        assert_eq!(d.torn_page_guard, Some(false));
        assert_eq!(parse("zdisk db powercut postgres --torn-page-guard off").torn_page_guard, Some(false));
    }
}
