//! The fleet's global limits against a real Redis the tests start
//! themselves (docs/fleet.md): the lease script against the pure allocator,
//! authentication, faults.

fn main() {
    flowctl_tests::need::run(flowctl_tests::trials![]);
}
