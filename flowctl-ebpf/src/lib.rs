#![no_std]
//! Empty on purpose: the programs are the `flowctl-xdp` binary, built for the
//! BPF target by `flowctl/build.rs`. flowctl build-depends on this library so
//! cargo rebuilds the object whenever these sources change.
