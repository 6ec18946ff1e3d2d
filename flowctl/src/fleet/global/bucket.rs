//! A simulated key's GCRA bucket parameters; re-rating one when its grant
//! changes is the kernel's own `gcra::retarget`, which mints no tokens: the credit the bucket holds, in
//! units, is kept (capped at the new depth), never scaled up with the
//! rate. Keeping the TAT in nanoseconds instead would turn a bucket's
//! credit of `x` ns into `x * new_rate` units, so a rate moved from an
//! empty bucket on one host to a full one on another would admit more than
//! L*t + B fleet-wide (docs/design.md, "Global limits: the bounds").

use flowctl_common::gcra;

/// A bucket's parameters for `rate` units per second and depth `burst`:
/// (emission interval in 1/256 ns, depth in ns), as the map stores them.
pub fn params(rate: u64, burst: u64) -> (u64, u64) {
    let interval = gcra::interval_fp(rate, 1);
    (interval, gcra::burst_ns(interval, burst))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    #[test]
    fn a_full_bucket_keeps_its_units_not_its_nanoseconds() {
        // 10/s depth 10 (1 s), full; re-rated to 100/s depth 100 (1 s):
        // still 10 units of credit, not 100.
        let now = 50 * SEC;
        let tat = gcra::retarget(now - SEC, now, params(10, 10), params(100, 100));
        let (interval, depth) = params(100, 100);
        let mut admitted = 0;
        let mut t = tat;
        while let Some(n) = gcra::admit(t, now, gcra::increment_ns(interval, 1), depth) {
            t = n;
            admitted += 1;
        }
        assert_eq!(admitted, 10);
    }

    #[test]
    fn lowering_caps_the_credit_at_the_new_depth() {
        let now = 50 * SEC;
        let tat = gcra::retarget(0, now, params(100, 100), params(10, 5));
        let (interval, depth) = params(10, 5);
        let mut admitted = 0;
        let mut t = tat;
        while let Some(n) = gcra::admit(t, now, gcra::increment_ns(interval, 1), depth) {
            t = n;
            admitted += 1;
        }
        assert_eq!(admitted, 5);
    }

    #[test]
    fn an_empty_bucket_stays_empty() {
        let now = 50 * SEC;
        let (_, depth) = params(10, 10);
        let tat = gcra::retarget(now + depth, now, params(10, 10), params(1000, 1000));
        assert_eq!(tat, now + params(1000, 1000).1);
    }
}
