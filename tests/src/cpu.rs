//! CPU time of this process and its children, for the benches' CPU-per-request
//! figures (10 ms resolution: measure phases of seconds).

/// `USER_HZ`: the unit of `/proc/PID/stat` CPU times (100 on Linux).
const CLK_TCK: f64 = 100.0;

/// CPU seconds (user + system) of this process and of its direct child processes.
pub fn cpu_seconds() -> f64 {
    let me = std::process::id();
    let ticks = |stat: &str| -> Option<(u32, u64)> {
        let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let ppid = rest.get(1)?.parse().ok()?;
        let t = rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?;
        Some((ppid, t))
    };
    let mut total = 0;
    if let Ok(s) = std::fs::read_to_string("/proc/self/stat") {
        total += ticks(&s).map_or(0, |(_, t)| t);
    }
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let path = entry.path().join("stat");
        if let Some((ppid, t)) = std::fs::read_to_string(path).ok().and_then(|s| ticks(&s))
            && ppid == me
        {
            total += t;
        }
    }
    total as f64 / CLK_TCK
}
