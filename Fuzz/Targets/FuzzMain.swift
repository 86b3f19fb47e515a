import Foundation
import Glibc

// The fuzz targets' entry. Built with `scripts/fuzz.sh` (SwiftPM `--sanitize=fuzzer
// --sanitize=address -Xswiftc -DKBFS_FUZZ`) it is a libFuzzer binary whose target is named
// by KBFS_FUZZ_TARGET; built plainly (`swift build`) it replays inputs through the same
// targets, so the committed corpus and every crash's regression input run without libFuzzer.

#if KBFS_FUZZ
    /// The target this process fuzzes, named once by KBFS_FUZZ_TARGET.
    let fuzzedTarget: FuzzTarget = {
        let name = ProcessInfo.processInfo.environment["KBFS_FUZZ_TARGET"] ?? ""
        guard let t = FuzzTarget.all.first(where: { $0.name == name }) else {
            say("KBFS_FUZZ_TARGET must name a target: \(FuzzTarget.all.map(\.name).joined(separator: " "))\n")
            exit(2)
        }
        return t
    }()

    /// libFuzzer's entry: one input through the named target.
    @_cdecl("LLVMFuzzerTestOneInput")
    public func fuzzOneInput(_ data: UnsafePointer<UInt8>?, _ size: Int) -> Int32 {
        let bytes = size == 0 ? [] : Array(UnsafeBufferPointer(start: data, count: size))
        fuzzedTarget.run(bytes)
        return 0
    }
#else
    /// `keybagfs-fuzz replay TARGET FILE|DIR...`: runs each input once (a crash is the failure);
    /// `keybagfs-fuzz list`: the targets' names.
    @main enum FuzzReplay {
        static func main() {
            let args = CommandLine.arguments.dropFirst()
            guard let verb = args.first else { usage() }
            if verb == "list" {
                for t in FuzzTarget.all { print(t.name) }
                return
            }
            guard verb == "replay", args.count >= 3,
                let target = FuzzTarget.all.first(where: { $0.name == args[args.startIndex + 1] })
            else { usage() }
            var count = 0
            for input in args.dropFirst(2).flatMap(files) {
                guard let d = FileManager.default.contents(atPath: input) else {
                    say("cannot read \(input)\n")
                    exit(1)
                }
                target.run([UInt8](d))
                count += 1
            }
            print("\(target.name): \(count) inputs replayed, none crashed")
        }

        /// The files of `path` (a file, or a folder's files).
        static func files(_ path: String) -> [String] {
            var isDir: ObjCBool = false
            guard FileManager.default.fileExists(atPath: path, isDirectory: &isDir), isDir.boolValue else {
                return [path]
            }
            let names = (try? FileManager.default.contentsOfDirectory(atPath: path)) ?? []
            return names.sorted().map { path + "/" + $0 }
        }

        /// The usage line, then exit 2.
        static func usage() -> Never {
            say("usage: keybagfs-fuzz list | replay TARGET FILE|DIR...\n")
            exit(2)
        }
    }
#endif
