//! The rank loop's model-time arithmetic.

use super::*;

const MS: Duration = Duration::from_millis(1);

#[test]
fn a_step_starts_at_the_arrival_when_idle_and_after_the_last_step_when_busy() {
    let now = Instant::now() + 10 * MS;
    assert_eq!(step_start(None, now), now);
    // The timer fired 0.6 ms after the last step's end: rounding, forgiven.
    let end = now - Duration::from_micros(600);
    assert_eq!(step_start(Some(end), now), end);
    // The last step "ends" in the future (it was not slept for): keep the debt.
    let ahead = now + Duration::from_micros(300);
    assert_eq!(step_start(Some(ahead), now), ahead);
    // 5 ms late: the CPU was busy, the engine really is behind.
    assert_eq!(step_start(Some(now - 5 * MS), now), now);
}

/// The loop's arithmetic against a timer that rounds every deadline up to the
/// next whole millisecond, as tokio's does: 1,000 back-to-back steps of 0.3 ms and
/// of 1.7 ms end within one resolution of their model time, where starting each
/// step when the timer fired would drift by the rounding of every step.
#[test]
fn timer_rounding_does_not_accumulate_over_busy_steps() {
    let t0 = Instant::now();
    let round_up = |t: Instant| {
        let since = (t - t0).as_nanos().div_ceil(MS.as_nanos());
        t0 + MS * u32::try_from(since).expect("a short simulated run")
    };
    for step in [Duration::from_micros(300), Duration::from_micros(1_700)] {
        let (mut now, mut clock) = (t0, None);
        for _ in 0..1_000 {
            let end = step_start(clock, now) + step;
            clock = Some(end);
            if end > now + TIMER_RESOLUTION {
                now = round_up(end);
            }
        }
        let model = t0 + step * 1_000;
        let drift = if now > model {
            now - model
        } else {
            model - now
        };
        assert!(
            drift <= TIMER_RESOLUTION,
            "{step:?} steps drifted {drift:?}"
        );
    }
}
