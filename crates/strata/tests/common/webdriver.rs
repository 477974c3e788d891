//! A small WebDriver client (plain JSON over HTTP to chromedriver) driving headless Chromium,
//! for the dashboard's browser test. Every process it starts is ended when it is dropped:
//! the session is closed, chromedriver is shut down, and any process still naming the
//! test's private profile directory is killed by its pid.
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use base64::Engine as _;
use serde_json::{json, Value};

use super::process::ChildGuard;
use super::find_tool;

const START_TIMEOUT: Duration = Duration::from_secs(30);
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// Where Chromium's binary is: Debian puts the real one under /usr/lib/chromium.
pub fn chromium_binary() -> Option<PathBuf> {
    let direct = PathBuf::from("/usr/lib/chromium/chromium");
    if direct.is_file() {
        return Some(direct);
    }
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| find_tool(name))
}

pub struct Browser {
    base: String,
    session: String,
    agent: ureq::Agent,
    driver: ChildGuard,
    profile: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver on a port it picks and opens a headless Chromium session.
    pub fn start(width: u32, height: u32) -> Browser {
        let chromium = chromium_binary().expect("chromium is not installed");
        let profile = tempfile::Builder::new()
            .prefix("strata-chromium-")
            .tempdir()
            .expect("profile dir");
        let mut cmd = Command::new("chromedriver");
        cmd.arg("--port=0").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null());
        let mut driver = ChildGuard::spawn(&mut cmd);
        let port = announced_port(&mut driver);
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(5))
            .timeout(CALL_TIMEOUT)
            .build();
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-crash-reporter",
            "--disable-breakpad",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            &format!("--user-data-dir={}", profile.path().display()),
            &format!("--window-size={width},{height}"),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": chromium.display().to_string(), "args": args},
        }}});
        let base = format!("http://127.0.0.1:{port}");
        let mut browser = Browser { base, session: String::new(), agent, driver, profile };
        let reply = browser.send("POST", "/session", Some(caps));
        browser.session = reply["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session id in {reply}"))
            .to_string();
        browser
    }

    fn send(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}{path}", self.base);
        let req = self.agent.request(method, &url);
        let result = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        let text = match result {
            Ok(r) => r.into_string(),
            Err(ureq::Error::Status(code, r)) => {
                panic!("WebDriver {method} {path}: HTTP {code}: {}", r.into_string().unwrap_or_default())
            }
            Err(e) => panic!("WebDriver {method} {path}: {e}"),
        }
        .unwrap_or_else(|e| panic!("WebDriver {method} {path}: {e}"));
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("WebDriver answer ({e}): {text}"));
        v["value"].clone()
    }

    fn session_path(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    pub fn goto(&self, url: &str) {
        self.send("POST", &self.session_path("/url"), Some(json!({"url": url})));
    }

    /// Runs `script` (a function body; `return` gives the value) in the page.
    pub fn eval(&self, script: &str) -> Value {
        self.send("POST", &self.session_path("/execute/sync"), Some(json!({"script": script, "args": []})))
    }

    /// A PNG of the viewport.
    pub fn screenshot(&self) -> Vec<u8> {
        let v = self.send("GET", &self.session_path("/screenshot"), None);
        let b64 = v.as_str().expect("screenshot is base64 text");
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .expect("screenshot decodes")
    }
}

/// Reads chromedriver's "started successfully on port N." line.
fn announced_port(driver: &mut ChildGuard) -> u16 {
    let stdout = driver.child().stdout.take().expect("chromedriver stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(rest) = line.split("started successfully on port ").nth(1) {
                let port = rest.trim().trim_end_matches('.').parse::<u16>().ok();
                let _ = tx.send(port);
            }
        }
    });
    match rx.recv_timeout(START_TIMEOUT) {
        Ok(Some(port)) if port != 0 => port,
        other => panic!("chromedriver did not announce its port ({other:?})"),
    }
}

extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}
const SIGKILL: i32 = 9;

/// Pids of processes whose command line names `needle`.
fn pids_naming(needle: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

impl Drop for Browser {
    fn drop(&mut self) {
        let quick = ureq::AgentBuilder::new().timeout(Duration::from_secs(10)).build();
        if !self.session.is_empty() {
            let _ = quick.delete(&format!("{}/session/{}", self.base, self.session)).call();
        }
        let _ = quick.get(&format!("{}/shutdown", self.base)).call();
        let _ = self.driver.wait_timeout(Duration::from_secs(5));
        // Whatever is left of this browser names its private profile directory.
        let profile = self.profile.path().display().to_string();
        for pid in pids_naming(&profile) {
            if pid != std::process::id() {
                // SAFETY: plain syscall on a browser process this test started; a process
                // that has exited meanwhile just makes it fail.
                unsafe { kill(pid as i32, SIGKILL) };
            }
        }
    }
}
