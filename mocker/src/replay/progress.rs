//! Progress of one replay pass, for a person watching: requests done, time elapsed,
//! time left.
//!
//! On a terminal it is an `indicatif` bar redrawn in place. Anywhere else (CI logs, a
//! pipe, `nohup`) a redrawn bar would be either invisible or a screenful of carriage
//! returns, so it prints one plain line every [`LINE_INTERVAL`] instead, from a task
//! that ticks on a `tokio` interval and reads a shared counter: completions cost one
//! atomic add, and nothing waits on the printer. Both modes end with one summary line.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// How often the plain-line mode prints.
pub const LINE_INTERVAL: Duration = Duration::from_secs(10);

/// The progress display of one pass. Call [`PassProgress::inc`] per finished request
/// and [`PassProgress::finish`] at the end; dropping it without `finish` stops the
/// display silently.
pub struct PassProgress {
    label: String,
    total: u64,
    done: Arc<AtomicU64>,
    start: Instant,
    display: Display,
}

enum Display {
    Hidden,
    Bar(ProgressBar),
    Lines(JoinHandle<()>),
}

impl PassProgress {
    /// Starts the display for a pass named `label` of `total` requests: a bar when
    /// stderr is a terminal, plain lines otherwise, nothing when `enabled` is false.
    /// Must be called inside a tokio runtime (the plain-line printer is a task).
    pub fn start(label: &str, total: usize, enabled: bool) -> Self {
        let total = total as u64;
        let done = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let display = if !enabled {
            Display::Hidden
        } else if std::io::stderr().is_terminal() {
            Display::Bar(bar(label, total))
        } else {
            let (label, done) = (label.to_owned(), Arc::clone(&done));
            Display::Lines(tokio::spawn(async move {
                let mut ticks = tokio::time::interval(LINE_INTERVAL);
                ticks.tick().await; // the first tick is immediate: skip the 0/N line
                loop {
                    ticks.tick().await;
                    let line =
                        status_line(&label, done.load(Ordering::Relaxed), total, start.elapsed());
                    eprintln!("{line}");
                }
            }))
        };
        Self {
            label: label.to_owned(),
            total,
            done,
            start,
            display,
        }
    }

    /// Counts one finished request.
    pub fn inc(&self) {
        self.done.fetch_add(1, Ordering::Relaxed);
        if let Display::Bar(bar) = &self.display {
            bar.inc(1);
        }
    }

    /// Ends the display and prints one summary line: requests done and elapsed time.
    pub fn finish(self) {
        match &self.display {
            Display::Hidden => return,
            Display::Bar(bar) => bar.finish_and_clear(),
            Display::Lines(task) => task.abort(),
        }
        let done = self.done.load(Ordering::Relaxed);
        eprintln!(
            "{:>14}: {done}/{} requests done in {:.0} s",
            self.label,
            self.total,
            self.start.elapsed().as_secs_f64()
        );
    }
}

impl Drop for PassProgress {
    fn drop(&mut self) {
        match &self.display {
            Display::Hidden => {}
            Display::Bar(bar) => bar.finish_and_clear(),
            Display::Lines(task) => task.abort(),
        }
    }
}

/// One plain progress line: `"{label}: 812/2000 requests done, 41 s elapsed, about
/// 60 s left"`. The estimate assumes the rest finishes at the rate so far; with nothing
/// done yet there is none.
pub fn status_line(label: &str, done: u64, total: u64, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64();
    let left = if done == 0 || done >= total {
        String::new()
    } else {
        let rest = secs * (total - done) as f64 / done as f64;
        format!(", about {rest:.0} s left")
    };
    format!("{label:>14}: {done}/{total} requests done, {secs:.0} s elapsed{left}")
}

fn bar(label: &str, total: u64) -> ProgressBar {
    let bar = ProgressBar::new(total);
    // The template is a literal known to be valid; fall back to the default otherwise.
    if let Ok(style) = ProgressStyle::with_template(
        "{prefix:>14} [{wide_bar}] {pos}/{len} requests, {elapsed} elapsed, {eta} left",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(label.to_owned());
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_line_estimates_the_rest_from_the_rate_so_far() {
        let line = status_line("kv", 500, 2000, Duration::from_secs(20));
        assert_eq!(
            line,
            "            kv: 500/2000 requests done, 20 s elapsed, about 60 s left"
        );
    }

    #[test]
    fn status_line_has_no_estimate_before_the_first_or_after_the_last() {
        let none = status_line("kv", 0, 10, Duration::from_secs(3));
        assert!(none.ends_with("0/10 requests done, 3 s elapsed"), "{none}");
        let all = status_line("kv", 10, 10, Duration::from_secs(9));
        assert!(all.ends_with("10/10 requests done, 9 s elapsed"), "{all}");
    }

    #[tokio::test]
    async fn hidden_progress_counts_and_prints_nothing() {
        let progress = PassProgress::start("kv", 3, false);
        progress.inc();
        progress.inc();
        assert_eq!(progress.done.load(Ordering::Relaxed), 2);
        progress.finish();
    }
}
