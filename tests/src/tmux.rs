//! `flowctl top` in a real terminal: a detached tmux session of a given
//! size, its captured screen, and the check that quitting restores the
//! terminal. Each pane has its own tmux server (`-L`, a socket of its
//! own): a new session never meets another test's server, nor one that is
//! still exiting after its last session ended. The session is killed and
//! its status file removed on drop, also when a test fails.

use crate::cli::bin;
use std::{
    path::PathBuf,
    process::{Command, Output},
    time::{Duration, Instant},
};

pub struct TopPane {
    session: String,
    /// `top`'s exit status: tmux's `#{pane_dead_status}` is not always
    /// filled in by the time the pane is reported dead.
    status_file: PathBuf,
    /// Said in front of every failure (the terminal's size, say).
    label: String,
    /// The server's socket, removed on drop (tmux leaves it behind).
    socket_path: Option<PathBuf>,
}

/// tmux on the pane's own server (`socket`: its name, the session's).
fn tmux(socket: &str, args: &[&str]) -> Output {
    Command::new("tmux").args(["-L", socket]).args(args).output().expect("tmux")
}

impl TopPane {
    /// Runs `flowctl top ARGS` in a `width` x `height` terminal.
    pub fn start(args: &str, width: u16, height: u16, label: &str) -> Self {
        let session = crate::unique("flowctl-top-");
        let status_file = std::env::temp_dir().join(format!("{session}.status"));
        let _ = std::fs::remove_file(&status_file);
        let cmd =
            format!("sh -c '{} top {args}; echo $? > {}'", bin().display(), status_file.display());
        let (w, h) = (width.to_string(), height.to_string());
        let out = tmux(&session, &["new-session", "-d", "-s", &session, "-x", &w, "-y", &h, &cmd]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        tmux(&session, &["set-option", "-t", &session, "remain-on-exit", "on"]);
        let socket = tmux(&session, &["display-message", "-p", "#{socket_path}"]);
        let socket_path = Some(String::from_utf8_lossy(&socket.stdout).trim().to_string())
            .filter(|p| !p.is_empty())
            .map(PathBuf::from);
        Self { session, status_file, label: label.to_string(), socket_path }
    }

    pub fn screen(&self) -> String {
        String::from_utf8_lossy(
            &tmux(&self.session, &["capture-pane", "-p", "-t", &self.session]).stdout,
        )
        .to_string()
    }

    pub fn send_keys(&self, keys: &str) {
        tmux(&self.session, &["send-keys", "-t", &self.session, keys]);
    }

    /// The screen once `ok` holds for it (within 10 s).
    pub fn wait_for(&self, ok: impl Fn(&str) -> bool, what: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = self.screen();
            if ok(&s) {
                return s;
            }
            assert!(Instant::now() < deadline, "{}: {what} never appeared:\n{s}", self.label);
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Quits with `q`: `top` exits with status 0, the alternate screen is
    /// off, and `drawn` (a text only the TUI shows) is gone from the screen.
    pub fn quit_and_check_restored(self, drawn: &str) {
        self.send_keys("q");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let dead = String::from_utf8_lossy(
                &tmux(
                    &self.session,
                    &["display-message", "-p", "-t", &self.session, "#{pane_dead} #{alternate_on}"],
                )
                .stdout,
            )
            .trim()
            .to_string();
            if dead.starts_with('1') {
                assert_eq!(dead, "1 0", "the alternate screen is off");
                let status = std::fs::read_to_string(&self.status_file).unwrap_or_default();
                assert_eq!(status.trim(), "0", "top exited with status 0");
                break;
            }
            assert!(Instant::now() < deadline, "top did not quit: {dead}");
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(!self.screen().contains(drawn), "the TUI is gone from the screen");
    }
}

impl Drop for TopPane {
    fn drop(&mut self) {
        tmux(&self.session, &["kill-server"]);
        if let Some(p) = &self.socket_path {
            let _ = std::fs::remove_file(p);
        }
        let _ = std::fs::remove_file(&self.status_file);
    }
}
