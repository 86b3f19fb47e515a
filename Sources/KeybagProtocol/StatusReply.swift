/// The `status` reply: the lock state and what the mount negotiated and holds.
public struct StatusReply: Codable, Sendable, Equatable {
    public var ok = true
    public var state: LockState
    public var protectedDataAvailable: Bool
    /// Seconds of grace a lock request without one gets.
    public var grace: Double
    public var openFiles: Int
    public var pid: Int
    public var mountpoint: String
    public var failedAttempts: Int
    /// Seconds before an unlock is accepted again (0: now).
    public var retryAfter: Int
    public var classADirectIO: Bool
    public var writebackCache: Bool
    public var posixACLs: Bool
    public var subscribers: Int
    /// The mounting user's uid (-1 when the daemon did not say).
    public var owner: Int
    public var defaultClass: String
    /// Whether the AES key schedules sit in locked memory.
    public var aesMemoryLocked: Bool
    /// Hours locked after which class C goes too; null: never.
    @NullWhenAbsent public var inactivityRelock: Double?
    /// Seconds until that happens, while locked; null otherwise.
    @NullWhenAbsent public var relockIn: Int?
    /// This device's id in the store; null for a store of one device from before devices.
    @NullWhenAbsent public var deviceID: String?
    public var keySet: Int
    /// Whether another device moved to a newer key set than this daemon holds.
    public var keySetBehind: Bool
    /// Files of the store's devices folder this device refused (a certificate, key-set or
    /// removal record not signed by a device it trusts), each with why.
    public var refusedRecords: [String]
    public var tpm2: TPMStatus

    /// Whether a TPM holds part of the passcode key, and its dictionary-attack state.
    public struct TPMStatus: Codable, Sendable, Equatable {
        public var inUse: Bool
        public var lockoutCounter: Int?
        public var maxTries: Int?
        /// Seconds after which one failure is forgiven.
        public var recoveryTime: Int?
        public var lockoutRecovery: Int?
        public var inLockout: Bool?
        public var lockoutAuthSet: Bool?
        /// Who holds the TPM's lockout authorization by this device's enrollment: `keybagfs` (set by
        /// keybagfs, cleared with the recovery key), `given` (another tool's, kept by keybagfs),
        /// `accepted` (a clearable lockout the user accepted); absent for enrollments older than this.
        public var lockoutAuthority: String?
        /// The PCRs (SHA-256 bank) the sealed secret is bound to; absent or empty: none.
        public var pcrs: [Int]?
        /// The key set an enrollment cut short had not yet moved every file to (`keybagfs rewrap`).
        public var rewrapPending: Int?
        /// Why the TPM's state could not be read.
        public var error: String?

        /// No TPM in use.
        public static let notInUse = TPMStatus(inUse: false)

        public init(
            inUse: Bool, lockoutCounter: Int? = nil, maxTries: Int? = nil, recoveryTime: Int? = nil,
            lockoutRecovery: Int? = nil, inLockout: Bool? = nil, lockoutAuthSet: Bool? = nil, error: String? = nil
        ) {
            self.inUse = inUse
            self.lockoutCounter = lockoutCounter
            self.maxTries = maxTries
            self.recoveryTime = recoveryTime
            self.lockoutRecovery = lockoutRecovery
            self.inLockout = inLockout
            self.lockoutAuthSet = lockoutAuthSet
            self.error = error
        }
    }

    enum CodingKeys: String, CodingKey {
        case ok, state, protectedDataAvailable, grace, openFiles, pid, mountpoint, failedAttempts, retryAfter
        case classADirectIO, writebackCache, posixACLs, subscribers, owner, defaultClass, aesMemoryLocked
        case inactivityRelock, relockIn, deviceID, keySet, keySetBehind, refusedRecords, tpm2
    }

    /// Decodes a status: the contract promises `state`, `protectedDataAvailable`, `grace`
    /// and `openFiles` (SPEC.md §5); every other field may be absent (a daemon of an older
    /// version) and then reads as "not known": 0, false, empty, or nil.
    public init(from decoder: any Decoder) throws {
        let c = try decoder.container(keyedBy: CodingKeys.self)
        func or<T: Decodable>(_ key: CodingKeys, _ absent: T) throws -> T {
            try c.decodeIfPresent(T.self, forKey: key) ?? absent
        }
        ok = try or(.ok, true)
        state = try c.decode(LockState.self, forKey: .state)
        protectedDataAvailable = try c.decode(Bool.self, forKey: .protectedDataAvailable)
        grace = try c.decode(Double.self, forKey: .grace)
        openFiles = try c.decode(Int.self, forKey: .openFiles)
        pid = try or(.pid, 0)
        mountpoint = try or(.mountpoint, "")
        failedAttempts = try or(.failedAttempts, 0)
        retryAfter = try or(.retryAfter, 0)
        classADirectIO = try or(.classADirectIO, false)
        writebackCache = try or(.writebackCache, false)
        posixACLs = try or(.posixACLs, false)
        subscribers = try or(.subscribers, 0)
        owner = try or(.owner, -1)
        defaultClass = try or(.defaultClass, "")
        aesMemoryLocked = try or(.aesMemoryLocked, false)
        _inactivityRelock = try or(.inactivityRelock, NullWhenAbsent(wrappedValue: nil))
        _relockIn = try or(.relockIn, NullWhenAbsent(wrappedValue: nil))
        _deviceID = try or(.deviceID, NullWhenAbsent(wrappedValue: nil))
        keySet = try or(.keySet, 0)
        keySetBehind = try or(.keySetBehind, false)
        refusedRecords = try or(.refusedRecords, [])
        tpm2 = try or(.tpm2, .notInUse)
    }

    /// A status of `state`; the daemon fills in the rest.
    public init(state: LockState, mountpoint: String, pid: Int, owner: Int, grace: Double, defaultClass: String) {
        self.state = state
        self.protectedDataAvailable = state == .unlocked
        self.mountpoint = mountpoint
        self.pid = pid
        self.owner = owner
        self.grace = grace
        self.defaultClass = defaultClass
        openFiles = 0
        failedAttempts = 0
        retryAfter = 0
        classADirectIO = false
        writebackCache = false
        posixACLs = false
        subscribers = 0
        aesMemoryLocked = false
        keySet = 0
        keySetBehind = false
        refusedRecords = []
        tpm2 = .notInUse
    }
}
