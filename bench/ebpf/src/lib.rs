#![no_std]
//! Empty: the programs are the `flowctl-bench-xdp` binary (see main.rs).
