//! Contract tests of the admin API against its OpenAPI document (docs/openapi.json): a live
//! daemon is driven through every documented operation, and each answer must have a status the
//! document lists for that operation and a body that validates against the schema given for it.
//! (That every route the router serves is documented is a unit test of the route table,
//! `api::tests::every_served_route_is_documented_and_every_documented_one_served`.)
use crate::common;

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use common::http::{background_load, request, Reply};
use common::*;
use serde_json::{json, Value};

const OPENAPI: &str = include_str!("../../../docs/openapi.json");
const TOKEN: &str = "contract-token-0123456789abcdef";
const METHODS: [&str; 7] = ["get", "put", "post", "delete", "patch", "head", "options"];

/// The JSON Schema dialect OpenAPI 3.1 schemas are written in.
const DRAFT: &str = "https://json-schema.org/draft/2020-12/schema";

struct Contract {
    doc: Value,
    /// Component schemas under `$defs`, so a validator can resolve references to them.
    defs: Value,
    compiler: boon::Compiler,
    schemas: boon::Schemas,
    /// The compiled schema of each answer checked so far, by "METHOD template status".
    compiled: HashMap<String, boon::SchemaIndex>,
    /// (METHOD, template, status) answered so far.
    seen: BTreeSet<(String, String, u16)>,
}

fn with_local_refs(v: &Value) -> Value {
    let text = v.to_string().replace("#/components/schemas/", "#/$defs/");
    serde_json::from_str(&text).expect("re-parse schema")
}

/// Does a concrete path like /api/v1/volumes/a/resize match a template?
fn matches_template(template: &str, path: &str) -> bool {
    let (t, p): (Vec<&str>, Vec<&str>) = (template.split('/').collect(), path.split('/').collect());
    t.len() == p.len()
        && t.iter().zip(&p).all(|(t, p)| (t.starts_with('{') && !p.is_empty()) || t == p)
}

impl Contract {
    fn load() -> Contract {
        let doc: Value = serde_json::from_str(OPENAPI).expect("docs/openapi.json is JSON");
        assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")), "not OpenAPI 3");
        let defs = with_local_refs(&doc["components"]["schemas"]);
        Contract {
            doc,
            defs,
            compiler: boon::Compiler::new(),
            schemas: boon::Schemas::new(),
            compiled: HashMap::new(),
            seen: BTreeSet::new(),
        }
    }

    /// Compiles `root` as file:///contract/`name`.json, a name used once (boon answers a
    /// second compile of a URL with the first one's schema). boon checks the whole document
    /// against its draft's meta-schema before compiling it, so an invalid schema anywhere in
    /// `root`, `$defs` included, is an error here.
    fn compile(&mut self, name: &str, root: Value) -> Result<boon::SchemaIndex, String> {
        let url = format!("file:///contract/{name}.json");
        self.compiler.add_resource(&url, root).map_err(|e| format!("{e:#}"))?;
        self.compiler.compile(&url, &mut self.schemas).map_err(|e| format!("{e:#}"))
    }

    /// The template and operation a request falls under; literal templates win over ones
    /// with parameters.
    fn operation(&self, method: &str, path: &str) -> (String, &Value) {
        let paths = self.doc["paths"].as_object().expect("paths");
        let mut candidates: Vec<&String> = paths.keys().filter(|t| matches_template(t, path)).collect();
        candidates.sort_by_key(|t| t.matches('{').count());
        let template = candidates
            .first()
            .unwrap_or_else(|| panic!("{method} {path}: no documented path matches"));
        let op = &paths[template.as_str()][method.to_lowercase()];
        assert!(op.is_object(), "{method} {template} is not documented");
        (template.to_string(), op)
    }

    fn schema(&mut self, key: &str, schema: &Value) -> boon::SchemaIndex {
        if let Some(index) = self.compiled.get(key) {
            return *index;
        }
        let root = json!({"$schema": DRAFT, "$defs": self.defs, "allOf": [with_local_refs(schema)]});
        let name = format!("answer-{}", self.compiled.len());
        let index = self.compile(&name, root).unwrap_or_else(|e| panic!("schema of {key} does not compile: {e}"));
        self.compiled.insert(key.to_string(), index);
        index
    }

    /// Checks one answer against the document.
    fn check(&mut self, method: &str, path_and_query: &str, reply: &Reply) {
        let path = path_and_query.split('?').next().unwrap_or(path_and_query);
        let (template, op) = self.operation(method, path);
        let status = reply.status.to_string();
        let response = op["responses"][&status].clone();
        assert!(
            response.is_object(),
            "{method} {path_and_query} answered {status}, which {template} does not document: {}",
            reply.body
        );
        let content = response["content"].as_object().cloned().unwrap_or_default();
        let key = format!("{method} {template} {status}");
        if let Some(media) = content.get("application/json") {
            assert!(reply.content_type.starts_with("application/json"), "{key}: {}", reply.content_type);
            let body = reply.json();
            let index = self.schema(&key, &media["schema"]);
            if let Err(e) = self.schemas.validate(&body, index) {
                panic!("{key}: the body does not match the document:\n{e:#}\n{body:#}");
            }
        } else if let Some(media) = content.keys().next() {
            assert!(reply.content_type.starts_with(media.as_str()), "{key}: {} is not {media}", reply.content_type);
            assert!(!reply.body.is_empty(), "{key}: empty body");
        }
        self.seen.insert((method.to_string(), template, reply.status));
    }

    /// Sends a request (with the token on anything but GET unless `token` says otherwise) and
    /// checks the answer, which must have `want` status.
    fn call(&mut self, base: &str, method: &str, path: &str, body: Option<Value>, token: Option<&str>, want: u16) -> Value {
        let reply = request(method, &format!("{base}{path}"), body.as_ref(), token);
        assert_eq!(reply.status, want, "{method} {path}: {}", reply.body);
        self.check(method, path, &reply);
        if reply.content_type.starts_with("application/json") { reply.json() } else { Value::Null }
    }

    fn documented(&self) -> BTreeSet<(String, String, u16)> {
        let mut out = BTreeSet::new();
        for (template, item) in self.doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("path item") {
                if !METHODS.contains(&method.as_str()) {
                    continue;
                }
                for status in op["responses"].as_object().expect("responses").keys() {
                    let code = status.parse().expect("numeric status");
                    out.insert((method.to_uppercase(), template.clone(), code));
                }
            }
        }
        out
    }
}

#[test]
fn the_document_is_valid_openapi_with_valid_schemas() {
    let mut c = Contract::load();
    for key in ["info", "paths", "components"] {
        assert!(c.doc[key].is_object(), "no {key}");
    }
    // Compiling checks the component schemas against the 2020-12 meta-schema; an error names
    // the one at fault by its place under /$defs.
    let components = json!({"$schema": DRAFT, "$defs": c.defs});
    if let Err(e) = c.compile("components", components) {
        panic!("components.schemas is not a set of valid JSON Schemas: {e}");
    }
    for (template, item) in c.doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("item") {
            if METHODS.contains(&method.as_str()) {
                assert!(op["responses"].as_object().is_some_and(|r| !r.is_empty()), "{method} {template}: no responses");
                assert!(op["operationId"].is_string(), "{method} {template}: no operationId");
            }
        }
    }
}

#[test]
fn every_documented_operation_answers_as_documented() {
    if !require_tools(&["fio"]) {
        return;
    }
    let token_dir = tempfile::tempdir().expect("tempdir");
    let token_file = token_dir.path().join("token");
    std::fs::write(&token_file, TOKEN).expect("token file");
    let opts = DaemonOpts {
        extra_args: vec!["--http-token-file".into(), token_file.display().to_string()],
        ..Default::default()
    };
    let daemon = Daemon::start(opts);
    let base = daemon.http_url();
    let mut c = Contract::load();
    let t = Some(TOKEN);

    // Some I/O first, so that rates, latencies and per-tier space are not all empty.
    qemu_io_ok(&daemon.nbd_uri(VOL0), &["write -P 0x5a 0 2M", "read -P 0x5a 0 1M"]);
    assert!(
        wait_until(Duration::from_secs(10), || {
            let h = common::http::get_json(&format!("{base}/api/v1/history"));
            h["samples"].as_array().is_some_and(|s| s.len() >= 2)
        }),
        "the sampler produced no history"
    );

    c.call(&base, "GET", "/", None, None, 200);
    c.call(&base, "GET", "/metrics", None, None, 200);
    let served = c.call(&base, "GET", "/api/v1/openapi.json", None, None, 200);
    assert_eq!(served, c.doc, "the daemon serves docs/openapi.json as built");
    let status = c.call(&base, "GET", "/api/v1/status", None, None, 200);
    assert!(status["latest"].is_object(), "{status}");
    c.call(&base, "GET", "/api/v1/node", None, None, 200);
    c.call(&base, "GET", "/api/v1/diskgroups", None, None, 200);
    c.call(&base, "GET", "/api/v1/devices", None, None, 200);
    let h = c.call(&base, "GET", "/api/v1/history", None, None, 200);
    let since = h["samples"][0]["t_unix_ms"].as_u64().expect("a sample");
    c.call(&base, "GET", &format!("/api/v1/history?since_unix_ms={since}"), None, None, 200);
    c.call(&base, "GET", "/api/v1/history?since_unix_ms=soon", None, None, 400);

    let create = json!({"name": "contract", "size_bytes": 1 << 20});
    c.call(&base, "GET", "/api/v1/volumes", None, None, 200);
    c.call(&base, "POST", "/api/v1/volumes", Some(create.clone()), None, 401);
    c.call(&base, "POST", "/api/v1/volumes", Some(create.clone()), t, 201);
    c.call(&base, "POST", "/api/v1/volumes", Some(create), t, 409);
    c.call(&base, "POST", "/api/v1/volumes", Some(json!({"name": "../x", "size_bytes": 4096})), t, 400);
    c.call(&base, "GET", "/api/v1/volumes/contract", None, None, 200);
    c.call(&base, "GET", "/api/v1/volumes/none", None, None, 404);

    let grow = json!({"size_bytes": 2 << 20});
    c.call(&base, "POST", "/api/v1/volumes/contract/resize", Some(grow.clone()), None, 401);
    c.call(&base, "POST", "/api/v1/volumes/contract/resize", Some(grow.clone()), t, 200);
    c.call(&base, "POST", "/api/v1/volumes/contract/resize", Some(json!({"size_bytes": 4096})), t, 400);
    c.call(&base, "POST", "/api/v1/volumes/none/resize", Some(grow), t, 404);

    // Tiering policies: created with a partial policy, changed with a partial PUT.
    let tiered = json!({"name": "contract-tier", "size_bytes": 1 << 20, "policy": {"mode": "tier", "iops_limit": 100}});
    let v = c.call(&base, "POST", "/api/v1/volumes", Some(tiered), t, 201);
    assert_eq!((v["policy"]["mode"].as_str(), v["policy"]["iops_limit"].as_u64()), (Some("tier"), Some(100)), "{v}");
    let policy = "/api/v1/volumes/contract-tier/policy";
    c.call(&base, "PUT", policy, Some(json!({"iops_limit": 0})), None, 401);
    let v = c.call(&base, "PUT", policy, Some(json!({"iops_limit": 0})), t, 200);
    assert_eq!((v["policy"]["mode"].as_str(), v["policy"]["iops_limit"].as_u64()), (Some("tier"), Some(0)), "{v}");
    c.call(&base, "PUT", policy, Some(json!({"promote_window_s": 0})), t, 400);
    c.call(&base, "PUT", "/api/v1/volumes/none/policy", Some(json!({})), t, 404);
    c.call(&base, "DELETE", "/api/v1/volumes/contract-tier", None, t, 200);


    // A volume in use: delete is refused (409) until forced or the client leaves.
    {
        // fio's nbd engine connects once to learn the size and closes that connection before
        // its job connects: wait for the job's I/O, not for the first connection (deleting
        // between the two succeeded on a slow run).
        let ops = |v: &Value| v["io"]["read_ops_total"].as_u64().unwrap_or(0) + v["io"]["write_ops_total"].as_u64().unwrap_or(0);
        let before = ops(&common::http::get_json(&format!("{base}/api/v1/volumes/contract")));
        let _load = background_load(&daemon.nbd_uri("contract"), 30, &daemon.scratch_dir());
        let connected = wait_until(Duration::from_secs(20), || {
            let v = common::http::get_json(&format!("{base}/api/v1/volumes/contract"));
            v["connections"].as_u64() >= Some(1) && ops(&v) > before
        });
        assert!(connected, "fio did not connect and start its I/O");
        c.call(&base, "DELETE", "/api/v1/volumes/contract", None, t, 409);
    }
    let idle = wait_until(Duration::from_secs(20), || {
        common::http::get_json(&format!("{base}/api/v1/volumes/contract"))["connections"].as_u64() == Some(0)
    });
    assert!(idle, "fio's connection is still counted after it was killed");
    snapshot_operations(&mut c, &daemon, t);
    scrub_operations(&mut c, &daemon, t);
    c.call(&base, "DELETE", "/api/v1/volumes/contract?force=maybe", None, t, 400);
    c.call(&base, "DELETE", "/api/v1/volumes/contract", None, None, 401);
    c.call(&base, "DELETE", "/api/v1/volumes/contract?force=true", None, t, 409);
    c.call(&base, "DELETE", "/api/v1/volumes/contract?force=true&with_snapshots=true", None, t, 200);
    c.call(&base, "DELETE", "/api/v1/volumes/contract", None, t, 404);

    // Every documented operation and answer was exercised, except the ones a healthy test
    // daemon cannot be made to give (no space, shutting down).
    let unreachable = [507, 503];
    let missing: Vec<_> = c
        .documented()
        .into_iter()
        .filter(|k| !unreachable.contains(&k.2) && !c.seen.contains(k))
        .collect();
    assert!(missing.is_empty(), "documented but never exercised: {missing:?}");
}

/// Ends an NBD connection and waits until the resource at `url` no longer counts it.
fn disconnect(held: nbd::Client, url: &str) {
    held.disconnect();
    let gone = wait_until(Duration::from_secs(20), || common::http::get_json(url)["connections"].as_u64() == Some(0));
    assert!(gone, "{url} still counts a connection that ended");
}

/// Snapshots, clones and rollback on a volume nobody has open; leaves `contract@s1` in place.
fn snapshot_operations(c: &mut Contract, daemon: &Daemon, t: Option<&str>) {
    let base = daemon.http_url();
    let snaps = "/api/v1/volumes/contract/snapshots";
    let s1 = json!({"name": "s1"});
    c.call(&base, "POST", snaps, Some(s1.clone()), None, 401);
    let taken = c.call(&base, "POST", snaps, Some(s1.clone()), t, 201);
    assert_eq!(taken["export_name"], "contract@s1", "{taken}");
    c.call(&base, "POST", snaps, Some(s1), t, 409);
    c.call(&base, "POST", snaps, Some(json!({"name": "a@b"})), t, 400);
    c.call(&base, "POST", "/api/v1/volumes/none/snapshots", Some(json!({"name": "x"})), t, 404);
    c.call(&base, "POST", snaps, Some(json!({"name": "s2"})), t, 201);
    let all = c.call(&base, "GET", "/api/v1/snapshots", None, None, 200);
    assert_eq!(all["snapshots"].as_array().map(Vec::len), Some(2), "{all}");
    c.call(&base, "GET", snaps, None, None, 200);
    c.call(&base, "GET", "/api/v1/volumes/none/snapshots", None, None, 404);
    c.call(&base, "GET", &format!("{snaps}/s1"), None, None, 200);
    c.call(&base, "GET", &format!("{snaps}/none"), None, None, 404);

    let clone = "/api/v1/volumes/contract/clone";
    let copy = json!({"snapshot": "s1", "name": "contract-copy"});
    c.call(&base, "POST", clone, Some(copy.clone()), None, 401);
    c.call(&base, "POST", clone, Some(copy.clone()), t, 201);
    c.call(&base, "POST", clone, Some(copy), t, 409);
    c.call(&base, "POST", clone, Some(json!({"snapshot": "s1"})), t, 400);
    c.call(&base, "POST", clone, Some(json!({"snapshot": "none", "name": "x"})), t, 404);
    c.call(&base, "DELETE", "/api/v1/volumes/contract-copy", None, t, 200);

    let rollback = "/api/v1/volumes/contract/rollback";
    let to_s1 = json!({"snapshot": "s1"});
    c.call(&base, "POST", rollback, Some(to_s1.clone()), None, 401);
    c.call(&base, "POST", rollback, Some(json!({"snapshot": 1})), t, 400);
    c.call(&base, "POST", rollback, Some(json!({"snapshot": "none"})), t, 404);
    let held = nbd::go(daemon.nbd_addr, "contract").expect("GO contract");
    c.call(&base, "POST", rollback, Some(to_s1.clone()), t, 409);
    disconnect(held, &format!("{base}/api/v1/volumes/contract"));
    c.call(&base, "POST", rollback, Some(to_s1), t, 200);

    let s2 = format!("{snaps}/s2");
    let held = nbd::go(daemon.nbd_addr, "contract@s2").expect("GO contract@s2");
    c.call(&base, "DELETE", &s2, None, t, 409);
    disconnect(held, &format!("{base}{s2}"));
    c.call(&base, "DELETE", &format!("{s2}?force=maybe"), None, t, 400);
    c.call(&base, "DELETE", &s2, None, None, 401);
    c.call(&base, "DELETE", &s2, None, t, 200);
    c.call(&base, "DELETE", &s2, None, t, 404);
}

/// Scrub: a healthy daemon's scrubs are clean; a second one is refused while a slow one runs.
fn scrub_operations(c: &mut Contract, daemon: &Daemon, t: Option<&str>) {
    let base = daemon.http_url();
    c.call(&base, "GET", "/api/v1/scrub", None, None, 200);
    c.call(&base, "POST", "/api/v1/scrub", None, None, 401);
    let report = c.call(&base, "POST", "/api/v1/scrub", None, t, 200);
    assert_eq!(report["clean"], true, "{report}");
    c.call(&base, "POST", "/api/v1/scrub", Some(json!({"volume": "none"})), t, 404);
    c.call(&base, "POST", "/api/v1/scrub", Some(json!({"volume": "contract", "speed": 1})), t, 400);

    // 48 KiB of data and the metadata at 128 KiB/s: a scrub of a second or so.
    c.call(&base, "POST", "/api/v1/volumes", Some(json!({"name": "scrubbed", "size_bytes": 64 << 20})), t, 201);
    let writes: Vec<String> = (0..12).map(|i| format!("write -P 0x3c {}M 4k", i * 4)).collect();
    let writes: Vec<&str> = writes.iter().map(String::as_str).collect();
    qemu_io_ok(&daemon.nbd_uri("scrubbed"), &writes);
    let slow_url = format!("{base}/api/v1/scrub");
    let slow = std::thread::spawn(move || {
        request("POST", &slow_url, Some(&json!({"volume": "scrubbed", "rate_bytes_per_s": 131072})), Some(TOKEN))
    });
    let running = wait_until(Duration::from_secs(20), || {
        common::http::get_json(&format!("{base}/api/v1/scrub"))["running"] == true
    });
    assert!(running, "the slow scrub never showed as running");
    c.call(&base, "POST", "/api/v1/scrub", None, t, 409);
    let reply = slow.join().expect("the slow scrub's thread");
    assert_eq!(reply.status, 200, "{}", reply.body);
    c.check("POST", "/api/v1/scrub", &reply);
    let state = c.call(&base, "GET", "/api/v1/scrub", None, None, 200);
    assert_eq!(state["last"]["scope"], "scrubbed", "{state}");
    assert!(state["last"]["data_bytes_verified"].as_u64() >= Some(12 * 4096), "{state}");

    // DELETE stops a running scrub: its requester hears 503 and the last result stays.
    c.call(&base, "DELETE", "/api/v1/scrub", None, t, 409);
    let slow_url = format!("{base}/api/v1/scrub");
    let slow = std::thread::spawn(move || {
        request("POST", &slow_url, Some(&json!({"volume": "contract", "rate_bytes_per_s": 1024})), Some(TOKEN))
    });
    let running = wait_until(Duration::from_secs(20), || {
        common::http::get_json(&format!("{base}/api/v1/scrub"))["running"] == true
    });
    assert!(running, "the scrub to cancel never showed as running");
    c.call(&base, "DELETE", "/api/v1/scrub", None, None, 401);
    let stopped = c.call(&base, "DELETE", "/api/v1/scrub", None, t, 200);
    assert_eq!(stopped["running"], false, "{stopped}");
    assert_eq!(stopped["last"]["scope"], "scrubbed", "{stopped}");
    let reply = slow.join().expect("the cancelled scrub's thread");
    assert_eq!(reply.status, 503, "{}", reply.body);
    c.check("POST", "/api/v1/scrub", &reply);

    // Not waited for: 202 and the progress at once; the scrub runs on until cancelled.
    let body = json!({"volume": "contract", "rate_bytes_per_s": 1024, "wait": false});
    let started = c.call(&base, "POST", "/api/v1/scrub", Some(body), t, 202);
    assert_eq!(started["running"], true, "{started}");
    let stopped = c.call(&base, "DELETE", "/api/v1/scrub", None, t, 200);
    assert_eq!(stopped["running"], false, "{stopped}");
}
