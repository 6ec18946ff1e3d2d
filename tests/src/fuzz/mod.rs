//! The differential fuzzer of docs/classification.md: a reference
//! classifier written from the document alone ([`reference`]), a seeded
//! structure-aware generator of frames and profiles ([`gen`]), and a runner
//! that sends every frame through the real XDP program with
//! `BPF_PROG_TEST_RUN` and compares the class and the counters the kernel
//! moved with the reference's ([`run`]).

pub mod gen;
pub mod reference;
pub mod run;
