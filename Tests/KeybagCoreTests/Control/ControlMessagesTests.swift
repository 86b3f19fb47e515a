import Foundation
import KeybagCore
import XCTest

/// The typed control protocol against golden lines. Each line below was produced by the
/// untyped encoder the protocol had before it had types (JSONSerialization of the same
/// values, keys sorted, slashes not escaped): the types must not change a byte.
final class ControlMessagesTests: XCTestCase {
    func testRepliesEncodeToTheGoldenLines() {
        var s = StatusReply(
            state: .locked, mountpoint: #"/home/u/Private "x""#, pid: 4242, owner: 1000, grace: 0.25,
            defaultClass: "complete")
        s.openFiles = 3
        s.failedAttempts = 2
        s.retryAfter = 60
        s.classADirectIO = true
        s.writebackCache = true
        s.posixACLs = true
        s.subscribers = 1
        s.inactivityRelock = 48
        s.relockIn = 172_799
        s.deviceID = "0123456789abcdef0123456789abcdef"
        s.keySet = 2
        s.keySetBehind = true
        s.tpm2 = .init(
            inUse: true, lockoutCounter: 1, maxTries: 32, recoveryTime: 600, lockoutRecovery: 86400, inLockout: false,
            lockoutAuthSet: true)
        XCTAssertEqual(
            ControlProtocol.encode(s),
            #"{"aesMemoryLocked":false,"classADirectIO":true,"defaultClass":"complete","deviceID":"0123456789abcdef0123456789abcdef","failedAttempts":2,"grace":0.25,"inactivityRelock":48,"keySet":2,"keySetBehind":true,"mountpoint":"/home/u/Private \"x\"","ok":true,"openFiles":3,"owner":1000,"pid":4242,"posixACLs":true,"protectedDataAvailable":false,"refusedRecords":[],"relockIn":172799,"retryAfter":60,"state":"locked","subscribers":1,"tpm2":{"inLockout":false,"inUse":true,"lockoutAuthSet":true,"lockoutCounter":1,"lockoutRecovery":86400,"maxTries":32,"recoveryTime":600},"writebackCache":true}"#
        )
        XCTAssertEqual(
            ControlProtocol.encode(StatusReply.TPMStatus(inUse: true, error: "the TPM did not answer: tcti")),
            #"{"error":"the TPM did not answer: tcti","inUse":true}"#)
        XCTAssertEqual(
            ControlProtocol.encode(
                PolicyReply(rules: [
                    .init(pattern: "Documents/**", protectionClass: "complete"),
                    .init(pattern: "Downloads", protectionClass: "none"),
                ])),
            #"{"ok":true,"rules":[{"class":"complete","pattern":"Documents/**"},{"class":"none","pattern":"Downloads"}]}"#
        )
        XCTAssertEqual(
            ControlProtocol.encode(
                ControlRefusal(.throttled, "too many failed attempts; retry in 60 s", retryAfter: 60)),
            #"{"error":"throttled","message":"too many failed attempts; retry in 60 s","ok":false,"retryAfter":60}"#)
        XCTAssertEqual(
            ControlProtocol.encode(
                ControlRefusal(.badPasscode, "wrong passcode; retry in 60 s", retryAfter: 60, failedAttempts: 6)),
            #"{"error":"badPasscode","failedAttempts":6,"message":"wrong passcode; retry in 60 s","ok":false,"retryAfter":60}"#
        )
        XCTAssertEqual(
            ControlProtocol.encode(ControlRefusal(.busy, "too many control connections for uid 1000")),
            #"{"error":"busy","message":"too many control connections for uid 1000","ok":false}"#)
        XCTAssertEqual(
            ControlProtocol.encode(
                EventLine(
                    event: .didReturnToBeforeFirstUnlock, state: .beforeFirstUnlock, time: "2026-11-26T13:24:21.045Z")),
            #"{"event":"deviceDidReturnToBeforeFirstUnlock","state":"beforeFirstUnlock","time":"2026-11-26T13:24:21.045Z"}"#
        )
        XCTAssertEqual(ControlProtocol.encode(StateReply(.locking)), #"{"ok":true,"state":"locking"}"#)
        XCTAssertEqual(ControlProtocol.encode(DoneReply()), #"{"ok":true}"#)
    }

    func testANullFieldIsWrittenAndReadBack() throws {
        let s = StatusReply(state: .unlocked, mountpoint: "/m", pid: 1, owner: 0, grace: 2, defaultClass: "none")
        let line = ControlProtocol.encode(s)
        XCTAssertTrue(line.contains(#""deviceID":null"#), line)
        XCTAssertTrue(line.contains(#""inactivityRelock":null"#), line)
        XCTAssertTrue(line.contains(#""relockIn":null"#), line)
        XCTAssertTrue(line.contains(#""grace":2,"#), line)
        XCTAssertEqual(ControlProtocol.decode(StatusReply.self, from: line), s)
        // A daemon that leaves a null field out still gives a status.
        let shorter = line.replacingOccurrences(of: #""deviceID":null,"#, with: "")
        XCTAssertNil(try XCTUnwrap(ControlProtocol.decode(StatusReply.self, from: shorter)).deviceID)
    }

    /// The contract promises four fields of a status (SPEC.md §5); a daemon of an older
    /// version sends fewer than this one, and its status must still read.
    func testAStatusWithOnlyTheContractsFieldsReads() throws {
        let line = #"{"grace":2.5,"ok":true,"openFiles":1,"protectedDataAvailable":true,"state":"unlocked"}"#
        guard case .success(let s)? = ControlProtocol.reply(StatusReply.self, from: line) else {
            return XCTFail("a status of the contract's four fields does not read")
        }
        XCTAssertEqual(s.state, .unlocked)
        XCTAssertEqual(s.grace, 2.5)
        XCTAssertEqual(s.openFiles, 1)
        XCTAssertEqual(s.owner, -1, "an owner not given is no uid (not root)")
        XCTAssertEqual(s.tpm2, .notInUse)
        XCTAssertNil(s.deviceID)
        XCTAssertNil(
            ControlProtocol.decode(StatusReply.self, from: #"{"ok":true,"state":"unlocked","grace":1}"#),
            "without the contract's fields it is not a status")
    }

    /// Any line whose `ok` is not true is a refusal, however little it says.
    func testEveryNotOKLineIsARefusal() {
        for (line, code, message, retry) in [
            (#"{"ok":false,"error":"internal"}"#, "internal", "internal", nil),
            (#"{"ok":false}"#, "error", "error", nil),
            (#"{"ok":false,"error":"throttled","message":"wait","retryAfter":2.5}"#, "throttled", "wait", 3),
        ] as [(String, String, String, Int?)] {
            guard case .failure(let r)? = ControlProtocol.reply(StateReply.self, from: line) else {
                XCTFail("\(line) is not read as a refusal")
                continue
            }
            XCTAssertEqual(r.error.rawValue, code, line)
            XCTAssertEqual(r.message, message, line)
            XCTAssertEqual(r.retryAfter, retry, line)
        }
    }

    func testRequestLinesAreTheGoldenLines() {
        XCTAssertEqual(ControlCall.status.line, #"{"op":"status"}"#)
        XCTAssertEqual(ControlCall.subscribe.line, #"{"op":"subscribe"}"#)
        XCTAssertEqual(ControlCall.policy.line, #"{"op":"policy"}"#)
        XCTAssertEqual(ControlCall.lock(grace: 86399.5).line, #"{"grace":86399.5,"op":"lock"}"#)
        XCTAssertEqual(ControlCall.lock(grace: nil).line, #"{"op":"lock"}"#)
        XCTAssertEqual(
            ControlCall.unlock(passcode: "é\u{1}\"\\/ \u{7f}").line,
            "{\"op\":\"unlock\",\"passcode\":\"é\\u0001\\\"\\\\/ \u{7f}\"}")
        XCTAssertEqual(ControlCall.passwd(old: "a", new: "b").line, #"{"new":"b","old":"a","op":"passwd"}"#)
    }

    func testAReplyLineIsTheExpectedReplyOrTheRefusal() {
        guard case .success(let r)? = ControlProtocol.reply(StateReply.self, from: #"{"ok":true,"state":"locked"}"#)
        else { return XCTFail("a state reply") }
        XCTAssertEqual(r.state, .locked)
        let refused = ControlProtocol.reply(
            StateReply.self, from: #"{"error":"someNewCode","message":"m","ok":false,"retryAfter":3}"#)
        guard case .failure(let f)? = refused else { return XCTFail("a refusal") }
        XCTAssertEqual(f.error.rawValue, "someNewCode")
        XCTAssertEqual(f.retryAfter, 3)
        XCTAssertNil(ControlProtocol.reply(StateReply.self, from: "not json"))
        XCTAssertNil(ControlProtocol.reply(StateReply.self, from: #"{"ok":true,"state":"sideways"}"#))
    }

    /// The daemon's side: a parsed line gives the command, or the refusal a client reads.
    func testRequestsBecomeCommandsOrRefusals() throws {
        func outcome(_ line: String) -> String {
            Array(line.utf8).withUnsafeBytes { raw in
                switch ControlRequest.parsed(raw) {
                case .failure(let r): return ControlProtocol.encode(r)
                case .success(let req):
                    defer { req.wipe() }
                    switch req.operation().flatMap(req.command) {
                    case .failure(let r): return ControlProtocol.encode(r)
                    case .success(.lock(let g)): return "lock \(g.map { "\($0)" } ?? "default")"
                    case .success(.unlock(let p)): return "unlock \(p.count)"
                    case .success(.passwd(let o, let n)): return "passwd \(o.count) \(n.count)"
                    case .success(let c): return "\(c)"
                    }
                }
            }
        }
        XCTAssertEqual(outcome(#"{"op":"status"}"#), "status")
        XCTAssertEqual(outcome(#"{"op":"lock"}"#), "lock default")
        XCTAssertEqual(outcome(#"{"op":"lock","grace":1.5}"#), "lock 1.5")
        XCTAssertEqual(outcome(#"{"op":"unlock","passcode":"abc"}"#), "unlock 3")
        XCTAssertEqual(outcome(#"{"op":"passwd","old":"ab","new":"abcd"}"#), "passwd 2 4")
        XCTAssertEqual(
            outcome(#"{"op":"lock","grace":"1"}"#),
            #"{"error":"badRequest","message":"\"grace\" must be a number of seconds from 0 to 86400","ok":false}"#)
        XCTAssertEqual(
            outcome(#"{"op":"unlock","passcode":""}"#),
            #"{"error":"badRequest","message":"not a flat JSON object: empty secret","ok":false}"#)
        XCTAssertEqual(
            outcome(#"{"op":"\#(String(repeating: "x", count: 50))"}"#),
            #"{"error":"badRequest","message":"unknown op \"\#(String(repeating: "x", count: 40))…\"","ok":false}"#)
        XCTAssertEqual(ControlOp.status.refusalForOthers, nil)
        XCTAssertEqual(ControlOp.lock.refusalForOthers?.message, "only root and the mounting user may lock")
    }
}
