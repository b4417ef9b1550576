//! The measuring phases of one target and workload: preconditioning to steady state, the
//! queue-depth points, and the consistency test.

use super::*;

impl Bench<'_> {
    pub(super) fn precondition(&mut self, ti: usize, data: DataMode, w: WorkloadKind) -> Result<()> {
        let cfg = self.cfg;
        let kind = self.targets[ti].kind;
        let qd = *cfg.qds.last().unwrap_or(&32);
        let per_round = (cfg.round_ms / cfg.log_ms).max(1) as usize;
        let mut rec = PreconditionRecord {
            data,
            workload: w,
            target: kind,
            qd,
            round_ms: cfg.round_ms,
            rounds_run: 0,
            round_iops: Vec::new(),
            iops_per_interval: Vec::new(),
            interval_ms: cfg.log_ms,
            steady_state_reached: false,
            verdict: String::new(),
            window: None,
            cost: JobCost::default(),
            error: None,
        };
        let est_total = self.precondition_est_ms();
        let mut spent = 0;
        // The first chunk is a whole window (nothing can be judged before that), then one
        // round per fio run, so the stop comes as soon as the criterion holds.
        let mut chunk = WINDOW_ROUNDS.min(cfg.max_rounds as usize) as u32;
        let mut sums = PreconditionSums { os_written: Some(0.0), ..PreconditionSums::default() };
        while chunk > 0 {
            self.check_stop()?;
            self.pb.set_message(format!(
                "{}: precondition {} QD{qd} ({}), round {}/{}",
                kind.key(),
                w.title(),
                data.key(),
                rec.rounds_run + chunk,
                cfg.max_rounds
            ));
            // Half an interval of slack so fio logs the chunk's last full interval too.
            let job = self.workload_job(ti, w, qd, data, chunk as u64 * cfg.round_ms + cfg.log_ms / 2, 0);
            let stem = self.next_stem(data, &format!("pre-{}", w.key()), kind);
            let phase = format!("precondition {}", w.title());
            let est = chunk as u64 * cfg.round_ms + cfg.log_ms / 2 + FIO_OVERHEAD_MS;
            match self.fio_job(ti, data, &phase, job, &stem) {
                Ok((out, cost)) => sums.add_chunk(&mut rec, &out, cost, per_round, chunk as usize),
                Err(e) => {
                    let msg = format!("precondition {} on {} ({}): {e:#}", w.title(), kind.key(), data.key());
                    self.say(&format!("ERROR {msg}"));
                    self.report.errors.push(msg.clone());
                    rec.error = Some(msg);
                    if e.to_string().contains("interrupted") {
                        return Err(e);
                    }
                    break;
                }
            }
            rec.rounds_run += chunk;
            spent += est;
            self.pb.inc(est);
            rec.window = steady::evaluate(&rec.round_iops);
            if rec.window.is_some_and(|w| w.steady) {
                rec.steady_state_reached = true;
                break;
            }
            chunk = (cfg.max_rounds - rec.rounds_run).min(1);
        }
        // Preconditioning usually ends before the budgeted limit: give the time back to the bar.
        if let Some(len) = self.pb.length() {
            self.pb.set_length(len.saturating_sub(est_total.saturating_sub(spent)));
        }
        self.record_precondition(rec, sums);
        Ok(())
    }

    /// Completes a preconditioning record with its totals and verdict, says it, and adds it
    /// to the report.
    fn record_precondition(&mut self, mut rec: PreconditionRecord, sums: PreconditionSums) {
        rec.cost.server_cpu_s = sums.cpu_s;
        rec.cost.os_write_amplification = sums.os_written;
        finish_cost(&mut rec.cost, sums.bytes, sums.written);
        rec.verdict = if rec.steady_state_reached {
            format!("steady state reached at round {}", rec.rounds_run)
        } else {
            format!("steady state not reached (limit {} rounds)", self.cfg.max_rounds)
        };
        if rec.error.is_none() {
            self.say(&format!(
                "[{}] precondition {} · {} · QD{}: {} (last window mean {} IOPS)",
                rec.data.key(),
                rec.workload.title(),
                rec.target.key(),
                rec.qd,
                rec.verdict,
                rec.window.map(|w| fmt_int(w.mean)).unwrap_or_else(|| "—".into())
            ));
        }
        self.report.preconditioning.push(rec);
    }

    pub(super) fn measure(&mut self, ti: usize, data: DataMode, w: WorkloadKind, qd: u32) -> Result<()> {
        let cfg = self.cfg;
        let kind = self.targets[ti].kind;
        self.pb.set_message(format!("{}: {} QD{qd} ({})", kind.key(), w.title(), data.key()));
        let job = self.workload_job(ti, w, qd, data, cfg.runtime_ms, cfg.ramp_ms);
        let stem = self.next_stem(data, &format!("{}-qd{qd}", w.key()), kind);
        let phase = format!("{} QD{qd}", w.title());
        let res = self.fio_job(ti, data, &phase, job, &stem);
        self.pb.inc(self.measure_est_ms());
        let mut r = JobResult {
            data,
            workload: w,
            workload_title: w.title(),
            target: kind,
            qd,
            iops: 0.0,
            read_iops: 0.0,
            write_iops: 0.0,
            mb_per_s: 0.0,
            p99_us: None,
            read_p99_us: None,
            write_p99_us: None,
            read_p50_us: None,
            write_p50_us: None,
            mean_lat_us: None,
            runtime_s: 0.0,
            cost: JobCost::default(),
            iops_per_interval: Vec::new(),
            interval_ms: cfg.log_ms,
            fio_json: format!("fio/{stem}.json"),
            error: None,
        };
        match res {
            Ok((out, cost)) => {
                r.iops = out.iops();
                r.read_iops = out.read.iops;
                r.write_iops = out.write.iops;
                r.mb_per_s = (out.read.bw_bytes_per_s + out.write.bw_bytes_per_s) / 1e6;
                r.read_p99_us = out.read.p99_us;
                r.write_p99_us = out.write.p99_us;
                r.p99_us = match (out.read.p99_us, out.write.p99_us) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                };
                r.read_p50_us = out.read.p50_us;
                r.write_p50_us = out.write.p50_us;
                let total_ios = out.read.iops + out.write.iops;
                r.mean_lat_us = if total_ios > 0.0 {
                    Some(
                        (out.read.mean_lat_us.unwrap_or(0.0) * out.read.iops
                            + out.write.mean_lat_us.unwrap_or(0.0) * out.write.iops)
                            / total_ios,
                    )
                } else {
                    None
                };
                r.runtime_s = out.runtime_s;
                r.iops_per_interval = out.iops_per_interval.clone();
                r.cost = cost;
                if r.iops <= 0.0 {
                    r.error = Some("fio completed no I/O".into());
                }
                self.say(&format!(
                    "[{}] {} · {} · QD{qd}: {} IOPS ({:.0} MB/s), p99 {} µs, {} CPU s/GiB{}",
                    data.key(),
                    w.title(),
                    kind.key(),
                    fmt_int(r.iops),
                    r.mb_per_s,
                    r.p99_us.map(fmt_int).unwrap_or_else(|| "—".into()),
                    r.cost.server_cpu_s_per_gib.map(|v| format!("{v:.2}")).unwrap_or_else(|| "—".into()),
                    r.cost.comp_ratio.map(|c| format!(", comp_ratio {c:.2}")).unwrap_or_default()
                ));
            }
            Err(e) => {
                if e.to_string().contains("interrupted") {
                    return Err(e);
                }
                let msg = format!("{} QD{qd} on {} ({}): {e:#}", w.title(), kind.key(), data.key());
                self.say(&format!("ERROR {msg}"));
                self.report.errors.push(msg.clone());
                r.error = Some(msg);
            }
        }
        self.report.results.push(r);
        Ok(())
    }

    pub(super) fn consistency_run(&mut self, ti: usize, data: DataMode, spare_pct: u32) -> Result<()> {
        let cfg = self.cfg;
        let kind = self.targets[ti].kind;
        let range = self.targets[ti].range_bytes;
        self.pb.set_message(format!(
            "{}: consistency 4K random write QD{} +{spare_pct}% spare ({})",
            kind.key(),
            cfg.consistency_qd,
            data.key()
        ));
        let mut job = self.job(ti, "consistency".into(), "randwrite", "4k", cfg.consistency_qd, data);
        job.runtime_ms = Some(cfg.consistency_ms);
        let stem = self.next_stem(data, &format!("consistency-spare{spare_pct}"), kind);
        let res = self.fio_job(ti, data, &format!("consistency +{spare_pct}% spare"), job, &stem);
        self.pb.inc(cfg.consistency_ms + FIO_OVERHEAD_MS);
        let mut rec = ConsistencyRecord {
            data,
            target: kind,
            spare_pct,
            range_bytes: range,
            qd: cfg.consistency_qd,
            iops_per_interval: Vec::new(),
            interval_ms: cfg.log_ms,
            mean_iops: 0.0,
            min_iops: 0.0,
            max_iops: 0.0,
            cov: 0.0,
            cost: JobCost::default(),
            error: None,
        };
        match res {
            Ok((out, cost)) => {
                let v = &out.iops_per_interval;
                if v.is_empty() {
                    rec.mean_iops = out.iops();
                    rec.min_iops = out.iops();
                    rec.max_iops = out.iops();
                } else {
                    let n = v.len() as f64;
                    let mean = v.iter().sum::<f64>() / n;
                    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
                    rec.mean_iops = mean;
                    rec.min_iops = v.iter().copied().fold(f64::INFINITY, f64::min);
                    rec.max_iops = v.iter().copied().fold(0.0, f64::max);
                    rec.cov = if mean > 0.0 { var.sqrt() / mean } else { 0.0 };
                }
                rec.iops_per_interval = out.iops_per_interval.clone();
                rec.cost = cost;
                self.say(&format!(
                    "[{}] consistency · {} · +{spare_pct}% spare: mean {} IOPS, min {}, CoV {:.2}",
                    data.key(),
                    kind.key(),
                    fmt_int(rec.mean_iops),
                    fmt_int(rec.min_iops),
                    rec.cov
                ));
            }
            Err(e) => {
                if e.to_string().contains("interrupted") {
                    return Err(e);
                }
                let msg = format!("consistency on {} +{spare_pct}% ({}): {e:#}", kind.key(), data.key());
                self.say(&format!("ERROR {msg}"));
                self.report.errors.push(msg.clone());
                rec.error = Some(msg);
            }
        }
        self.report.consistency.push(rec);
        Ok(())
    }
}

/// What a preconditioning's fio runs add up to.
#[derive(Default)]
struct PreconditionSums {
    cpu_s: f64,
    bytes: u64,
    written: u64,
    /// Bytes the OS wrote to the backing device, while every run could tell.
    os_written: Option<f64>,
}

impl PreconditionSums {
    /// Adds one fio run of `chunk` rounds: its per-interval IOPS and round means go into
    /// `rec`, its costs into the sums.
    fn add_chunk(
        &mut self,
        rec: &mut PreconditionRecord,
        out: &FioOutcome,
        cost: JobCost,
        per_round: usize,
        chunk: usize,
    ) {
        let keep = out.iops_per_interval.len().min(chunk * per_round);
        let intervals = &out.iops_per_interval[..keep];
        rec.iops_per_interval.extend_from_slice(intervals);
        let full = (intervals.len() / per_round).min(chunk);
        if full == 0 {
            // Shorter log than a round (very short rounds): use the run's mean.
            rec.round_iops.push(out.iops());
        }
        for r in 0..full {
            let slice = &intervals[r * per_round..(r + 1) * per_round];
            rec.round_iops.push(slice.iter().sum::<f64>() / per_round as f64);
        }
        self.cpu_s += cost.server_cpu_s;
        self.bytes += out.bytes();
        self.written += out.write.io_bytes;
        // fio_job already turned OS write bytes into a ratio; back to bytes to sum.
        self.os_written =
            self.os_written.zip(cost.os_write_amplification).map(|(a, ratio)| a + ratio * out.write.io_bytes as f64);
        rec.cost.comp_ratio = cost.comp_ratio;
        rec.cost.write_amplification = cost.write_amplification;
        rec.cost.zdisk_stat = cost.zdisk_stat;
    }
}
