//! The fleet's global limits against a real Redis the tests start
//! themselves (docs/fleet.md): the lease script against the pure allocator,
//! authentication (passwords, ACL users, TLS), heartbeats, FLUSHALL,
//! SIGSTOP/SIGCONT. Each test starts its own `redis-server` in a namespace
//! of its own and stops it by PID.

mod leases;
mod redis;

use leases::*;

fn main() {
    use flowctl_tests::need::Need::*;
    flowctl_tests::need::run(flowctl_tests::trials![
        lease_script_agrees_with_allocator: [Root, Command("redis-server"), Command("redis-cli")],
        redis_auth_password_and_acl_user: [Root, Command("redis-server"), Command("redis-cli")],
        flushall_learns_and_keeps_the_bound: [Root, Command("redis-server"), Command("redis-cli")],
        sigstop_is_detected_and_grants_are_kept: [Root, Command("redis-server"), Command("redis-cli")],
        redis_over_tls: [Root, Command("redis-server"), Command("redis-cli"), Command("openssl")],
    ]);
}
